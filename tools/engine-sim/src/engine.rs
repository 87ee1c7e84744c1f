//! The shared state of one engine: holds, allocation, eviction, prefill
//! compute and the params that describe held blocks. The READ side
//! (consuming a peer's params) is in [`crate::pull`].
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use tracing::{debug, warn};

use crate::blocks::{BlockAllocator, Hold};
use crate::config::{Role, SimConfig};
use crate::kv::{KvMemory, VerifyOutcome};
use crate::managed;
use crate::metrics;
use crate::params::{HeldBlocks, kv_transfer_params};
use crate::profile::CostProfile;
use crate::stats::{PrefillLogEntry, READ_LOG_CAPACITY, ReadLogEntry, Stats, StatsSnapshot};
use crate::tokenizer::tokenize_body_with;
use crate::transfer::KvTransfer;

/// How long blocks of an abandoned READ stay out of use, ms: well beyond
/// any READ's timeout (5 s default), so the provider has completed or failed it.
pub const PARKED_BLOCKS_MS: u64 = 60_000;

/// Shared state of one engine.
pub struct Engine {
    pub(crate) cfg: SimConfig,
    pub(crate) advertised_host: String,
    pub(crate) side_port: u16,
    pub(crate) start: Instant,
    pub(crate) alloc: Mutex<BlockAllocator>,
    pub(crate) holds: Mutex<HashMap<String, Hold>>,
    pub(crate) transfer: Arc<dyn KvTransfer>,
    pub(crate) stats: Stats,
    pub(crate) last_tokens_header: Mutex<Option<String>>,
    pub(crate) last_params: Mutex<Option<Value>>,
    pub(crate) next_request: AtomicU64,
    pub(crate) kv: Option<Arc<KvMemory>>,
    pub(crate) profile: Option<CostProfile>,
    /// Holds claimed by a reader (`defer_release`): freed by the owner
    /// notification or when the deadline passes.
    pub(crate) reading: Mutex<HashMap<String, Hold>>,
    pub(crate) metrics: metrics::Metrics,
    pub(crate) read_log: Mutex<std::collections::VecDeque<ReadLogEntry>>,
    /// Prefills computed (`GET /sim/prefills`).
    pub(crate) prefill_log: Mutex<std::collections::VecDeque<PrefillLogEntry>>,
    /// Blocks of abandoned READs, out of use until the deadline
    /// ([`Engine::park_blocks`]).
    pub(crate) parked: Mutex<Vec<(Instant, Vec<u32>)>>,
    /// `--prefill-concurrency` slots (`None`: no limit).
    pub(crate) prefill_slots: Option<tokio::sync::Semaphore>,
    pub(crate) agent: Option<Arc<managed::AgentLink>>,
    /// Managed mode: the agent connection was lost; holds are swept locally.
    pub(crate) agent_lost: std::sync::atomic::AtomicBool,
    pub(crate) agent_reports_failed: AtomicU64,
}

impl Engine {
    /// Counters.
    pub fn stats(&self) -> StatsSnapshot {
        let s = &self.stats;
        StatsSnapshot {
            requests: s.requests.load(Ordering::Relaxed),
            reads_ok: s.reads_ok.load(Ordering::Relaxed),
            reads_declined: s.reads_declined.load(Ordering::Relaxed),
            invalid_params: s.invalid_params.load(Ordering::Relaxed),
            reused_tokens: s.reused_tokens.load(Ordering::Relaxed),
            computed_tokens: s.computed_tokens.load(Ordering::Relaxed),
            side_reads_served: s.side_reads_served.load(Ordering::Relaxed),
            side_reads_refused: s.side_reads_refused.load(Ordering::Relaxed),
            verified_blocks: s.verified_blocks.load(Ordering::Relaxed),
            mismatched_blocks: s.mismatched_blocks.load(Ordering::Relaxed),
            kv_mode: Some(self.cfg.kv_mode),
            holds: self.holds.lock().len() as u64,
            profile: self.profile.clone(),
            time_scale: Some(self.cfg.time_scale),
            last_tokens_header: self.last_tokens_header.lock().clone(),
            last_kv_transfer_params: self.last_params.lock().clone(),
        }
    }

    /// Takes `ids` out of use because an abandoned READ may still write
    /// them, and returns as many fresh blocks for the request to compute
    /// into. The node agent's dataplane quarantines them as READ
    /// destinations until the provider completes; the engine, which writes
    /// and serves them itself, keeps them out of use for
    /// [`PARKED_BLOCKS_MS`] (freed by [`Engine::sweep`]). Without fresh
    /// blocks free, the caller gets an empty list and the request recomputes
    /// without KV to serve.
    pub(crate) async fn park_blocks(&self, ids: Vec<u32>) -> Vec<u32> {
        let n = ids.len();
        self.metrics.parked_blocks.inc_by(n as i64);
        self.parked.lock().push((
            Instant::now() + std::time::Duration::from_millis(PARKED_BLOCKS_MS),
            ids,
        ));
        self.allocate_blocks(n).await
    }

    /// Free every hold whose deadline has passed.
    pub(crate) fn sweep(&self, now: Instant) {
        {
            let mut parked = self.parked.lock();
            let mut alloc = self.alloc.lock();
            parked.retain(|(until, ids)| {
                if *until <= now {
                    alloc.release(ids);
                    self.metrics.parked_blocks.dec_by(ids.len() as i64);
                    false
                } else {
                    true
                }
            });
        }
        let mut holds = self.holds.lock();
        let agent_lost = self.agent_lost.load(Ordering::Relaxed);
        let expired: Vec<String> = holds
            .iter()
            .filter(|(_, h)| h.expires_at <= now && (!h.agent_lease || agent_lost))
            .map(|(k, _)| k.clone())
            .collect();
        let mut alloc = self.alloc.lock();
        for k in expired {
            if let Some(h) = holds.remove(&k) {
                alloc.release(&h.block_ids);
            }
        }
        let mut reading = self.reading.lock();
        reading.retain(|_, h| {
            if h.expires_at <= now {
                alloc.release(&h.block_ids);
                false
            } else {
                true
            }
        });
    }

    /// Frees the blocks of a hold the node agent released (managed mode:
    /// all owner notifications received, lease lapsed, or evicted).
    pub(crate) fn release_held(&self, request_id: &str) {
        let h = self.holds.lock().remove(request_id);
        if let Some(h) = h {
            self.alloc.lock().release(&h.block_ids);
        }
    }

    /// Frees the blocks of a claimed hold (owner notification received).
    pub(crate) fn release_reading(&self, request_id: &str) {
        let h = self.reading.lock().remove(request_id);
        if let Some(h) = h {
            self.alloc.lock().release(&h.block_ids);
        }
    }

    /// Evicts the holds that expire first until `n_blocks` are free
    /// (a full cache drops retained KV, as vLLM's prefix cache does).
    /// Managed mode: a hold leased at the agent is freed only once the
    /// agent has ended its lease (so no reader can renew it any more); the
    /// agent refuses (`lease_in_use`) while a reader that renewed it is
    /// reading, and the engine evicts another hold instead.
    pub(crate) async fn evict_for(&self, n_blocks: usize) {
        let mut order: Vec<(Instant, String, bool)> = self
            .holds
            .lock()
            .iter()
            .map(|(k, h)| (h.expires_at, k.clone(), h.agent_lease))
            .collect();
        order.sort();
        let reg = self.kv.as_ref().and_then(|k| k.registration()).cloned();
        for (_, k, agent_lease) in order {
            if self.alloc.lock().free_blocks() >= n_blocks {
                break;
            }
            if let (true, Some(reg)) = (agent_lease, &reg) {
                match reg.release(&k).await {
                    Ok(()) => {}
                    // Gone at the agent already (notified, expired): its
                    // release event may still be on the way.
                    Err(managed::ClientError::Api(e)) if e.kind == managed::ErrorKind::Lease => {}
                    Err(e) => {
                        debug!(request = %k, error = %e, "lease kept by the agent; not evicted");
                        continue;
                    }
                }
            }
            let h = self.holds.lock().remove(&k);
            if let Some(h) = h {
                self.alloc.lock().release(&h.block_ids);
            }
        }
    }

    /// Simulated compute time of `new_tokens` prompt tokens after `ctx_tokens`
    /// cached ones (profile or `prefill_us_per_token`), scaled by `time_scale`.
    pub fn prefill_time(&self, new_tokens: u64, ctx_tokens: u64) -> Duration {
        let ms = match &self.profile {
            Some(p) => p.prefill_ms(new_tokens, ctx_tokens),
            None => (self.cfg.prefill_us_per_token * new_tokens) as f64 / 1000.0,
        };
        Duration::from_secs_f64((ms * self.cfg.time_scale).max(0.0) / 1000.0)
    }

    /// Tokens of a request body with this engine's tokenizer.
    pub(crate) fn tokenize(&self, body: &Value) -> Result<Vec<u32>, String> {
        tokenize_body_with(self.cfg.tokenizer, body)
    }

    pub(crate) fn log_prefill(&self, entry: PrefillLogEntry) {
        let mut log = self.prefill_log.lock();
        if log.len() >= READ_LOG_CAPACITY {
            log.pop_front();
        }
        log.push_back(entry);
    }

    /// Waits for a prefill slot (`--prefill-concurrency`; none without a
    /// limit); the slot is held until the permit drops.
    pub(crate) async fn prefill_slot(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        match &self.prefill_slots {
            Some(s) => s.acquire().await.ok(),
            None => None,
        }
    }

    pub(crate) fn log_read(&self, entry: ReadLogEntry) {
        let mut log = self.read_log.lock();
        if log.len() >= READ_LOG_CAPACITY {
            log.pop_front();
        }
        log.push_back(entry);
    }

    /// Computes the prompt: sleeps the simulated time of tokens
    /// `reused..n` while writing their KV (real KV) and finishing the
    /// verification of the READ blocks; when verification found a mismatch,
    /// recomputes the reused part too. Returns the tokens finally reused.
    pub(crate) async fn compute_prompt(
        self: &Arc<Self>,
        ids: &[u32],
        tokens: &Arc<Vec<u32>>,
        reused: u64,
        verify: Option<tokio::task::JoinHandle<VerifyOutcome>>,
    ) -> u64 {
        let n = tokens.len() as u64;
        let sleep = tokio::time::sleep(self.prefill_time(n - reused, reused));
        let write = {
            let kv = self.kv.clone();
            let ids = ids.to_vec();
            let tokens = tokens.clone();
            tokio::task::spawn_blocking(move || {
                if let Some(kv) = kv {
                    kv.write_tokens(&ids, &tokens, reused as usize, tokens.len());
                }
            })
        };
        let verify = async move {
            match verify {
                Some(h) => h.await.ok(),
                None => None,
            }
        };
        let ((), _, outcome) = tokio::join!(sleep, write, verify);
        let mut reused = reused;
        if let Some(o) = outcome {
            self.stats
                .verified_blocks
                .fetch_add(o.verified_blocks, Ordering::Relaxed);
            self.stats
                .mismatched_blocks
                .fetch_add(o.mismatched_blocks, Ordering::Relaxed);
            self.metrics.verified_blocks.inc_by(o.verified_blocks);
            self.metrics.mismatched_blocks.inc_by(o.mismatched_blocks);
            if let Some(last) = self.read_log.lock().back_mut() {
                last.verified_blocks = o.verified_blocks;
                last.mismatched_blocks = o.mismatched_blocks;
            }
            if o.mismatched_blocks > 0 {
                warn!(engine = %self.cfg.engine_id, mismatched = o.mismatched_blocks,
                      "READ KV differs from the locally computed KV; recomputing");
                let sleep = tokio::time::sleep(self.prefill_time(reused, 0));
                let kv = self.kv.clone();
                let ids = ids.to_vec();
                let tokens = tokens.clone();
                let upto = reused as usize;
                let write = tokio::task::spawn_blocking(move || {
                    if let Some(kv) = kv {
                        kv.write_tokens(&ids, &tokens, 0, upto);
                    }
                });
                let _ = tokio::join!(sleep, write);
                reused = 0;
            }
        }
        self.stats
            .reused_tokens
            .fetch_add(reused, Ordering::Relaxed);
        self.stats
            .computed_tokens
            .fetch_add(n - reused, Ordering::Relaxed);
        self.metrics.reused_tokens.inc_by(reused);
        self.metrics.computed_tokens.inc_by(n - reused);
        reused
    }

    /// How long D holds a finished request's blocks.
    pub(crate) fn decoder_ttl(&self) -> Duration {
        Duration::from_millis(self.cfg.decoder_kv_blocks_ttl_ms)
    }

    /// Blocks needed for `num_tokens` tokens (at least one).
    pub(crate) fn blocks_for(&self, num_tokens: u64) -> usize {
        num_tokens
            .div_ceil(u64::from(self.cfg.block_size_tokens))
            .max(1) as usize
    }

    /// Allocate `n_blocks` blocks (after sweeping lapsed holds when short;
    /// empty when the cache is full).
    pub(crate) async fn allocate_blocks(&self, n_blocks: usize) -> Vec<u32> {
        if let Some(ids) = self.alloc.lock().allocate(n_blocks) {
            return ids;
        }
        self.sweep(Instant::now());
        if let Some(ids) = self.alloc.lock().allocate(n_blocks) {
            return ids;
        }
        if self.kv.is_some() {
            self.evict_for(n_blocks).await;
        }
        self.alloc.lock().allocate(n_blocks).unwrap_or_default()
    }

    /// Holds `ids` (covering `num_tokens` tokens) for `ttl` under
    /// `request_id` for a reader and returns the `kv_transfer_params` that
    /// describe them, or null when they cannot be read (managed mode: the
    /// agent did not retain them, see [`Engine::retain_at_agent`]).
    /// `cached_tokens`: P's prompt tokens not computed (its params'
    /// `remote_prefill_cached_tokens`).
    pub(crate) async fn hold(
        &self,
        request_id: &str,
        ids: Vec<u32>,
        num_tokens: u64,
        ttl: Duration,
        cached_tokens: Option<u64>,
    ) -> Value {
        self.hold_blocks(request_id, ids.clone(), num_tokens, ttl);
        if self.retain_at_agent(request_id, &ids, ttl).await {
            self.params(request_id, ids, num_tokens, cached_tokens)
        } else {
            Value::Null
        }
    }

    /// Hold `ids` (covering `num_tokens` tokens) for `ttl` under `request_id`.
    pub(crate) fn hold_blocks(
        &self,
        request_id: &str,
        ids: Vec<u32>,
        num_tokens: u64,
        ttl: Duration,
    ) {
        self.holds.lock().insert(
            request_id.to_string(),
            Hold {
                block_ids: ids,
                num_tokens,
                expires_at: Instant::now() + ttl,
                // Managed mode: the agent's to release from the start, so
                // that neither the sweep nor an eviction frees the blocks
                // while the retain is under way.
                agent_lease: self.kv.as_ref().is_some_and(|k| k.registration().is_some()),
            },
        );
    }

    /// Managed mode: retains a new hold's blocks at the node agent, before
    /// its params leave the engine (a reader's lease check must find them).
    /// Returns whether the params may be sent: `false` when the agent did
    /// not retain them, or when the hold was evicted meanwhile; the hold is
    /// then dropped (and any lease the agent made of it released), and the
    /// caller sends no params: the next turn recomputes.
    pub(crate) async fn retain_at_agent(
        &self,
        request_id: &str,
        ids: &[u32],
        ttl: Duration,
    ) -> bool {
        let Some(reg) = self.kv.as_ref().and_then(|k| k.registration()) else {
            return true;
        };
        let r = reg.retain(request_id, ids, ttl.as_millis() as u64).await;
        let still_held = self.holds.lock().contains_key(request_id);
        if r.is_ok() && still_held {
            return true;
        }
        match r {
            Ok(()) => debug!(request = %request_id, "hold evicted while being retained"),
            Err(e) => warn!(engine = %self.cfg.engine_id, request = %request_id, error = %e,
                            "the agent did not retain the blocks; no params sent"),
        }
        if let Err(e) = reg.release(request_id).await {
            debug!(request = %request_id, error = %e, "no lease to release");
        }
        self.release_held(request_id);
        false
    }

    /// The `kv_transfer_params` of a hold ([`crate::params`]).
    pub(crate) fn params(
        &self,
        request_id: &str,
        block_ids: Vec<u32>,
        num_tokens: u64,
        cached_tokens: Option<u64>,
    ) -> Value {
        let expiry_s = (self.cfg.role == Role::Decode).then(|| {
            (self.start.elapsed() + Duration::from_millis(self.cfg.decoder_kv_blocks_ttl_ms))
                .as_secs_f64()
        });
        let held = HeldBlocks {
            request_id,
            block_ids,
            num_tokens,
            cached_tokens,
            expiry_s,
        };
        kv_transfer_params(&self.cfg, &self.advertised_host, self.side_port, held)
    }

    /// Reports one prefill to the node agent (when configured), in the
    /// background; failures are counted and logged once.
    pub(crate) fn report_prefill(
        self: &Arc<Self>,
        prompt_tokens: u64,
        reused_tokens: u64,
        took: Duration,
    ) {
        let Some(agent) = self.agent.clone() else {
            return;
        };
        let e = self.clone();
        tokio::spawn(async move {
            if let Err(err) = agent
                .record_prefill(
                    &e.cfg.engine_id,
                    prompt_tokens,
                    reused_tokens,
                    took.as_micros() as u64,
                )
                .await
                && e.agent_reports_failed.fetch_add(1, Ordering::Relaxed) == 0
            {
                warn!(engine = %e.cfg.engine_id, error = %err, "prefill report to the agent failed");
            }
        });
    }

    /// Decode time of `n` output tokens, µs, scaled by `time_scale`.
    pub(crate) fn decode_us(&self, n: u64) -> u64 {
        ((self.cfg.decode_us_per_token * n) as f64 * self.cfg.time_scale) as u64
    }

    pub(crate) fn new_request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{}-req-{n}", self.cfg.engine_id)
    }
}
