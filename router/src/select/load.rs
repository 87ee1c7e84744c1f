//! What the router knows of engine load from its own requests: outstanding
//! prefill tokens per prefill engine, in-flight decode streams per decode
//! engine, and each prefill engine's measured cost per token (an EWMA of
//! completed prefills). No I/O; time comes from the injected [`Clock`].
//! Indexed by registry index.
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::line::{Fifo, Item};
use super::share::drop_conversations;
pub use super::share::{ShareLine, SharedLine};
use crate::clock::Clock;

/// A pulled prefill's READ as P's agent will abandon it
/// (`kvloop_router_api::abandon::foreseen_abandon_ms`; the selection's
/// [`super::Prediction::abandon`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Abandon {
    /// After this long from sending, ms.
    pub after_ms: f64,
    /// P's compute of the whole prompt once it recomputes, ms.
    pub compute_ms: f64,
    /// The READ's predicted time, ms: a prefill sent before the READ was
    /// due to end may reach P's line first and finish first without this
    /// READ being late (see [`PrefillGuard`]).
    pub read_ms: f64,
    /// P's agent notices its cut ([`LoadBook::pull_abandoned`];
    /// `notices_abandoned_pulls` in its model): the book waits for that
    /// instead of assuming the cut at `after_ms` ([`Fifo::settle`]).
    pub noticed: bool,
}

/// A pulled prefill, for [`LoadBook::begin_prefill`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pull {
    /// Its [`pull_digest`] (0: not known), which the agent's notices
    /// match ([`LoadBook::pull_abandoned`], [`LoadBook::pull_read`]).
    pub digest: u64,
    /// P's agent notices when its READ completes (`notices_read_pulls`
    /// in its model; [`super::Prediction::read_noticed`]): it is not in
    /// P's compute line until then, since P computes other turns while it
    /// READs, and joins the line's tail at the notice. Without it, a pull
    /// holds its place in line from when it was sent (see
    /// [`PrefillGuard`] for how a pull overtaken leaves it). Ignored with
    /// a digest of 0 (no notice could match it).
    pub read_noticed: bool,
}

/// Weight of a new sample in the measured prefill cost (EWMA).
pub const EWMA_ALPHA: f64 = 0.2;

#[derive(Default)]
struct Engine {
    outstanding_prefill_tokens: AtomicU64,
    inflight_decode_streams: AtomicU32,
    /// f64 bits of ms per token; 0 = no sample yet.
    ms_per_token_bits: AtomicU64,
    /// Requests waiting or computing as the engine last reported them
    /// (`vllm:num_requests_waiting` + `vllm:num_requests_running`);
    /// `u32::MAX`: not reported.
    reported_requests: AtomicU32,
    /// Of those, the ones beyond the prefills this replica knew of when
    /// the report came ([`LoadBook::set_reported_requests`]).
    reported_unknown: AtomicU32,
    /// f64 bits of the KV cache usage (0..1) the engine last reported
    /// (`vllm:kv_cache_usage_perc`); `u64::MAX`: not reported.
    kv_usage_bits: AtomicU64,
    /// Outstanding prefills in the order sent (the remaining-work estimate).
    fifo: Mutex<Fifo>,
    /// Other replicas' outstanding prefills (empty with one replica).
    shared: Mutex<SharedLine>,
}

/// How long a conversation routed here stays superseded in what other
/// replicas share, ms: longer than their shares live
/// (`crate::load_share::LOAD_SHARE_MAX_AGE_PERIODS` periods).
pub const SUPERSEDED_KEEP_MS: u64 = 5_000;

/// Most conversations remembered as superseded.
const SUPERSEDED_MAX: usize = 1024;

/// [`LoadBook::remaining_ms`] of one engine and how many prefills it
/// counts (this replica's and the shared ones), in one pass over each line.
fn known_work(e: &Engine, now_ms: u64) -> (f64, usize) {
    let (own_head, own_total, own_done, own_n) = {
        let mut f = e.fifo.lock();
        f.settle(now_ms);
        (
            f.items
                .iter()
                .find(|x| x.queued())
                .map(|x| (x.sent_ms, x.compute_us)),
            f.items
                .iter()
                .filter(|x| x.queued())
                .map(|x| x.compute_us)
                .sum::<u64>(),
            f.last_done_ms,
            f.items.len(),
        )
    };
    // Shared pulls still READing count among P's requests, not its work.
    let (shared_head, shared_total, shared_done, shared_n) = {
        let s = e.shared.lock();
        (
            s.items.iter().map(|x| (x.0, x.1)).min_by_key(|x| x.0),
            s.items.iter().map(|x| x.1).sum::<u64>(),
            s.last_done_ms,
            s.items.len() + s.reading as usize,
        )
    };
    let n = own_n + shared_n;
    // The earlier sent of the two heads (ours on a tie).
    let Some((head_sent_ms, head_us)) = own_head.into_iter().chain(shared_head).min_by_key(|x| x.0)
    else {
        return (0.0, n);
    };
    let head_since_ms = head_sent_ms.max(own_done.max(shared_done).unwrap_or(0));
    let done_us = now_ms.saturating_sub(head_since_ms).saturating_mul(1000);
    let ms = (own_total + shared_total).saturating_sub(done_us.min(head_us)) as f64 / 1e3;
    (ms, n)
}

/// Per-engine load counters, shared by the request tasks.
pub struct LoadBook {
    engines: Vec<Engine>,
    /// Conversations this replica routed a turn of lately, with when
    /// (see [`LoadBook::supersede`]).
    superseded: Mutex<VecDeque<(u64, u64)>>,
    /// f64 bits of the EWMA of predicted compute per prefill, ms (0: none yet).
    mean_prefill_ms_bits: AtomicU64,
    clock: Arc<dyn Clock>,
    next_id: AtomicU64,
}

/// Outstanding prefill tokens on one engine while alive.
///
/// Dropped when P answered: P computes one prefill at a time, first come
/// first served, so the next one in its line starts now. A pulled prefill
/// sent before this one and still outstanding has been overtaken: it
/// joins P's compute line only when its READ ends (vLLM schedules a
/// request once its remote KV arrived; `kvloop-engine-sim` likewise), and
/// a READ that runs long (a degraded path) would otherwise stand at the
/// head of the line and make P look busy for as long as it lasts. It stays
/// counted in the engine's requests (P reports it as waiting) and leaves
/// the book when P answers it. Where its READ's predicted time is known
/// ([`Abandon::read_ms`]) and this one was sent before that READ was due
/// to end, finishing first says nothing of the READ (this one reached P's
/// line first, the pull joined it behind): the pull keeps its place and
/// starts now. Otherwise `make demo-cluster` saw such a pull booked, past
/// its abandon deadline, as a whole-prompt recompute that P never did (a
/// phantom 1.4 s queue that sent a turn to the busier P).
pub struct PrefillGuard {
    book: Arc<LoadBook>,
    engine: u16,
    tokens: u64,
    id: u64,
}

impl Drop for PrefillGuard {
    fn drop(&mut self) {
        if let Some(e) = self.book.engines.get(usize::from(self.engine)) {
            e.outstanding_prefill_tokens
                .fetch_sub(self.tokens, Ordering::Relaxed);
            let mut f = e.fifo.lock();
            if let Some(pos) = f.items.iter().position(|x| x.id == self.id) {
                let done = f.items.remove(pos).map_or(0, |x| x.sent_ms);
                let (mut was_head, mut behind) = (true, false);
                for x in f.items.iter_mut().take(pos) {
                    // Sent before x's READ was due to end, `done` may have
                    // reached P's line first: x's READ is not late, x
                    // joined the line behind `done` and starts now.
                    // One whose READ's end is noticed is not in line
                    // until it is: neither.
                    let late = x.read_end_ms.is_none_or(|end| done >= end);
                    let guessed = x.pulled && !x.awaits_read_notice();
                    behind |= guessed && !late && !x.overtaken;
                    x.overtaken |= guessed && late;
                    was_head &= !x.queued();
                }
                if was_head || behind {
                    // The next one starts now.
                    f.last_done_ms = Some(self.book.clock.now_ms());
                }
            }
        }
    }
}

/// Names one pull for [`LoadBook::begin_prefill`] and
/// [`LoadBook::pull_abandoned`]: the digest of D's
/// engine id and the request id its blocks are held under
/// (`remote_engine_id`, `remote_request_id` of the params sent to P; the
/// agent's [`kvloop_router_api::PullNotice`] carries both). Never 0.
pub fn pull_digest(decode_engine_id: &str, decode_request_id: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(decode_engine_id.as_bytes());
    h.update(&[0]);
    h.update(decode_request_id.as_bytes());
    h.digest().max(1)
}

/// One in-flight decode stream on one engine while alive.
pub struct DecodeGuard {
    book: Arc<LoadBook>,
    engine: u16,
}

impl Drop for DecodeGuard {
    fn drop(&mut self) {
        if let Some(e) = self.book.engines.get(usize::from(self.engine)) {
            e.inflight_decode_streams.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl LoadBook {
    /// Counters for `n` engines (the registry's size), all zero; times
    /// from `clock`.
    pub fn new(n: usize, clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            engines: (0..n)
                .map(|_| Engine {
                    reported_requests: AtomicU32::new(u32::MAX),
                    reported_unknown: AtomicU32::new(0),
                    kv_usage_bits: AtomicU64::new(u64::MAX),
                    ..Engine::default()
                })
                .collect(),
            superseded: Mutex::new(VecDeque::new()),
            mean_prefill_ms_bits: AtomicU64::new(0),
            clock,
            next_id: AtomicU64::new(0),
        })
    }

    /// Count `tokens` (and `compute_ms`, the selection's prediction of
    /// their compute, when there is one) outstanding on prefill engine
    /// `engine` until the guard drops; `pull`: sent with D's params (P
    /// READs the prefix first, [`Pull`]). `abandon`: P's agent abandons that READ
    /// after [`Abandon::after_ms`] and P then computes the whole prompt
    /// (`None`: it does not, or no prediction). `conversation`: its
    /// digest ([`crate::store::ConvKey::digest`], 0: none), shared with
    /// the line (see [`LoadBook::supersede`]). An unknown index counts
    /// nothing.
    pub fn begin_prefill(
        self: &Arc<Self>,
        engine: u16,
        tokens: u64,
        compute_ms: Option<f64>,
        pull: Option<Pull>,
        abandon: Option<Abandon>,
        conversation: u64,
    ) -> PrefillGuard {
        let pulled = pull.is_some();
        let compute_ms = compute_ms.filter(|m| m.is_finite() && *m >= 0.0);
        let compute_us = compute_ms.map_or(0, |m| (m * 1e3) as u64);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Some(e) = self.engines.get(usize::from(engine)) {
            e.outstanding_prefill_tokens
                .fetch_add(tokens, Ordering::Relaxed);
            let now = self.clock.now_ms();
            let abandon_in = abandon.filter(|_| pulled);
            let abandon = abandon_in
                .filter(|a| a.after_ms.is_finite() && a.compute_ms.is_finite())
                .map(|a| {
                    (
                        now.saturating_add(a.after_ms.max(0.0).ceil() as u64),
                        (a.compute_ms.max(0.0) * 1e3) as u64,
                    )
                });
            let read_end_ms = abandon_in
                .filter(|a| a.read_ms.is_finite())
                .map(|a| now.saturating_add(a.read_ms.max(0.0).ceil() as u64));
            e.fifo.lock().items.push_back(Item {
                id,
                sent_ms: now,
                compute_us,
                pulled,
                overtaken: false,
                abandon,
                read_end_ms,
                noticed: abandon_in.is_some_and(|a| a.noticed),
                conversation,
                pull: pull.map_or(0, |p| p.digest),
                read_noticed: pull.is_some_and(|p| p.read_noticed && p.digest != 0),
            });
        }
        if let Some(m) = compute_ms {
            let _ = self.mean_prefill_ms_bits.fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |bits| {
                    Some(
                        if bits == 0 {
                            m.max(f64::MIN_POSITIVE)
                        } else {
                            let old = f64::from_bits(bits);
                            old + EWMA_ALPHA * (m - old)
                        }
                        .to_bits(),
                    )
                },
            );
        }
        PrefillGuard {
            book: self.clone(),
            engine,
            tokens,
            id,
        }
    }

    /// P's agent says the READ of pull `digest` ([`pull_digest`]) ended
    /// without the blocks (abandoned, failed or declined): P recomputes the whole
    /// prompt from now, in its compute line with the whole prompt's
    /// predicted compute ([`Abandon::compute_ms`]; its suffix's where none
    /// was foreseen). Without the notice the router learns it only when P
    /// answers ([`Fifo::settle`] guesses it only for overtaken pulls past
    /// their deadline). Returns whether this replica has that pull
    /// outstanding (another replica's, or one already answered: ignored).
    pub fn pull_abandoned(&self, digest: u64) -> bool {
        self.on_pull(digest, |f, pos, x, now| {
            let whole_us = x.abandon.map_or(x.compute_us, |a| a.1);
            if x.read_noticed {
                // Not in line while it READ: it joins now.
                f.join_tail(pos, whole_us, now);
            } else {
                f.items[pos] = x.in_line(now, whole_us);
            }
        })
    }

    /// P's agent says the READ of pull `digest` ([`pull_digest`]) completed
    /// with the blocks: P's engine now queues the turn's suffix, behind
    /// what it already has (its compute line's tail, from now). Changes
    /// nothing for a pull whose READ's end is not noticed
    /// ([`Pull::read_noticed`]: it kept its place in line) or that is no
    /// longer READing. Returns whether this replica has that pull
    /// outstanding.
    pub fn pull_read(&self, digest: u64) -> bool {
        self.on_pull(digest, |f, pos, x, now| {
            if x.read_noticed {
                f.join_tail(pos, x.compute_us, now);
            }
        })
    }

    /// Finds this replica's outstanding prefill of pull `digest` and, if
    /// it is still a pull, calls `apply(line, position, item, now ms)`.
    /// Returns whether it was found (0 never is).
    fn on_pull(&self, digest: u64, apply: impl FnOnce(&mut Fifo, usize, Item, u64)) -> bool {
        if digest == 0 {
            return false;
        }
        let now = self.clock.now_ms();
        for e in &self.engines {
            let mut f = e.fifo.lock();
            if let Some(pos) = f.items.iter().position(|x| x.pull == digest) {
                let x = f.items[pos];
                if x.pulled {
                    apply(&mut f, pos, x, now);
                }
                return true;
            }
        }
        false
    }

    /// Count one decode stream on `engine` until the guard drops.
    pub fn begin_decode(self: &Arc<Self>, engine: u16) -> DecodeGuard {
        if let Some(e) = self.engines.get(usize::from(engine)) {
            e.inflight_decode_streams.fetch_add(1, Ordering::Relaxed);
        }
        DecodeGuard {
            book: self.clone(),
            engine,
        }
    }

    /// A completed prefill of `tokens` computed tokens that took `elapsed_ms`
    /// on `engine`: updates its measured ms per token (EWMA, α =
    /// [`EWMA_ALPHA`]). Ignores empty or non-finite samples.
    pub fn record_prefill(&self, engine: u16, tokens: u64, elapsed_ms: f64) {
        let Some(e) = self.engines.get(usize::from(engine)) else {
            return;
        };
        if tokens == 0 || !elapsed_ms.is_finite() || elapsed_ms < 0.0 {
            return;
        }
        let sample = elapsed_ms / tokens as f64;
        let _ = e
            .ms_per_token_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = if bits == 0 {
                    sample
                } else {
                    old + EWMA_ALPHA * (sample - old)
                };
                Some(new.to_bits())
            });
    }

    /// Outstanding prefill tokens on `engine`.
    pub fn outstanding_prefill_tokens(&self, engine: u16) -> u64 {
        self.engines
            .get(usize::from(engine))
            .map_or(0, |e| e.outstanding_prefill_tokens.load(Ordering::Relaxed))
    }

    /// Records what `engine` reported of its queue, `requests` (`None`:
    /// not reported, e.g. the scrape failed), and how many of those go
    /// beyond the prefills known now (this replica's and the shared ones).
    /// Requests beyond the known ones are sent by routers that do not
    /// share. [`LoadBook::queue_ms`] counts the fewer of two estimates of
    /// them: beyond the prefills known when the report came, and beyond
    /// those known when the turn is routed. The first alone turns a share
    /// that lands after the report into a double count; the second alone
    /// turns a prefill P finished after its report (gone from the book,
    /// still in the report) into a request nobody knows, costed at the
    /// mean (`make demo-cluster`: a P idle for 0.4 s predicted 0.9 s busy,
    /// in the up to `load_interval_ms` after each prefill P finished).
    /// Both under-count a request of a router that does not share sent
    /// after the report, until the next one.
    pub fn set_reported_requests(&self, engine: u16, requests: Option<u32>) {
        if let Some(e) = self.engines.get(usize::from(engine)) {
            let n = requests.map_or(u32::MAX, |n| n.min(u32::MAX - 1));
            let unknown = requests.map_or(0, |n| {
                let (_, known) = known_work(e, self.clock.now_ms());
                (n as usize)
                    .saturating_sub(known)
                    .min(u32::MAX as usize - 1) as u32
            });
            e.reported_unknown.store(unknown, Ordering::Relaxed);
            e.reported_requests.store(n, Ordering::Relaxed);
        }
    }

    /// Queue ahead of a new prefill on `engine` at `now_ms`, ms, from
    /// predicted compute: the work the prefills this replica knows of
    /// (its own and, where replicas share their lines, the others') still
    /// have ([`LoadBook::remaining_ms`]), plus the mean prediction for each
    /// request the engine last reported beyond those (sent by routers that
    /// do not share; counted as [`LoadBook::set_reported_requests`] says). The mean is this replica's (an EWMA of its
    /// predictions) or, before it predicted anything (a replica just
    /// started or restarted), that of the prefills the other replicas
    /// share, so that it sees their work at once instead of every P idle;
    /// `None` when there is neither. Known prefills are costed by their own
    /// predictions and progress, not as the mean: a report counts a
    /// prefill about to finish like one just begun.
    pub fn queue_ms(&self, engine: u16, now_ms: u64) -> Option<f64> {
        let e = self.engines.get(usize::from(engine))?;
        let mean_ms = match self.mean_prefill_ms_bits.load(Ordering::Relaxed) {
            0 => self.shared_mean_ms()?,
            bits => f64::from_bits(bits),
        };
        let (known, known_items) = known_work(e, now_ms);
        let unknown = match e.reported_requests.load(Ordering::Relaxed) {
            u32::MAX => 0,
            n => (n as usize)
                .saturating_sub(known_items)
                .min(e.reported_unknown.load(Ordering::Relaxed) as usize),
        };
        Some(known + unknown as f64 * mean_ms)
    }

    /// Mean predicted compute of the prefills other replicas share, over
    /// every engine, ms (`None` when they share none).
    fn shared_mean_ms(&self) -> Option<f64> {
        let (sum_us, n) = self.engines.iter().fold((0u64, 0usize), |(s, n), e| {
            let line = e.shared.lock();
            (
                s.saturating_add(line.items.iter().map(|x| x.1).sum::<u64>()),
                n + line.items.len(),
            )
        });
        (n > 0).then(|| sum_us as f64 / 1e3 / n as f64)
    }

    /// Work the outstanding prefills on `engine` still have at `now_ms`,
    /// ms, as a first-come-first-served engine computes them: this
    /// replica's and, where replicas share their lines
    /// ([`LoadBook::set_shared_line`]), the others', merged by when they
    /// were sent. The sum of their predicted compute, less what the head of
    /// the merged line has done since it could start (sent, and the one
    /// before it finished), at most its own prediction: a P deep into a
    /// long prefill does not look as busy as when it began. A pulled
    /// prefill overtaken by a later one is left out: it is still READing
    /// ([`PrefillGuard`]).
    pub fn remaining_ms(&self, engine: u16, now_ms: u64) -> f64 {
        self.engines
            .get(usize::from(engine))
            .map_or(0.0, |e| known_work(e, now_ms).0)
    }

    /// This replica's line on `engine` at `now_ms`, to share with the
    /// other replicas (`None` for an unknown engine).
    pub fn own_line(&self, engine: u16, now_ms: u64) -> Option<ShareLine> {
        let e = self.engines.get(usize::from(engine))?;
        let mut f = e.fifo.lock();
        f.settle(now_ms);
        let queued = || f.items.iter().filter(|x| x.queued());
        let conversations: Vec<u64> = queued().map(|x| x.conversation).collect();
        Some(ShareLine {
            items: queued()
                .map(|x| (now_ms.saturating_sub(x.sent_ms), x.compute_us))
                .collect(),
            conversations: if conversations.iter().all(|&c| c == 0) {
                Vec::new()
            } else {
                conversations
            },
            done_age_ms: f.last_done_ms.map(|d| now_ms.saturating_sub(d)),
            reading: f.reading(),
        })
    }

    /// Replaces what the other replicas have outstanding on `engine`
    /// (empty: nothing, or not shared).
    pub fn set_shared_line(&self, engine: u16, mut line: SharedLine) {
        if let Some(e) = self.engines.get(usize::from(engine)) {
            let gone = self.superseded(self.clock.now_ms());
            drop_conversations(&mut line, gone.iter());
            drop(gone);
            *e.shared.lock() = line;
        }
    }

    /// The other replicas' prefills on `engine` as this replica holds
    /// them: `(sent at ms, predicted compute µs)`.
    pub fn shared_items(&self, engine: u16) -> Vec<(u64, u64)> {
        self.engines
            .get(usize::from(engine))
            .map(|e| e.shared.lock().items.iter().map(|x| (x.0, x.1)).collect())
            .unwrap_or_default()
    }

    /// A turn of `conversation` ([`crate::store::ConvKey::digest`]) is
    /// being routed here: any prefill of that conversation another replica
    /// shares, sent before now, is gone (a client sends one turn of a
    /// conversation at a time, so such a prefill finished, or its replica
    /// died and the client retried here), now and for
    /// [`SUPERSEDED_KEEP_MS`] of their shares. One sent later is the
    /// conversation's next turn and counts.
    /// Without this, a replica killed with prefills in flight left them in
    /// the shared lines until its share aged out, and the retried turns
    /// were routed around a queue P no longer had (`make demo-cluster`).
    pub fn supersede(&self, conversation: u64) {
        if conversation == 0 {
            return;
        }
        let now = self.clock.now_ms();
        {
            let mut q = self.superseded.lock();
            q.push_back((conversation, now));
            while q.len() > SUPERSEDED_MAX {
                q.pop_front();
            }
        }
        for e in &self.engines {
            drop_conversations(&mut e.shared.lock(), [(conversation, now)].iter());
        }
    }

    /// The conversations superseded within [`SUPERSEDED_KEEP_MS`] of
    /// `now_ms`, locked (older ones are forgotten).
    fn superseded(&self, now_ms: u64) -> parking_lot::MutexGuard<'_, VecDeque<(u64, u64)>> {
        let mut q = self.superseded.lock();
        while q
            .front()
            .is_some_and(|&(_, at)| now_ms.saturating_sub(at) > SUPERSEDED_KEEP_MS)
        {
            q.pop_front();
        }
        q
    }

    /// Records the KV cache usage `engine` reported (0..1; `None`: not
    /// reported, e.g. the scrape failed).
    pub fn set_kv_usage(&self, engine: u16, usage: Option<f64>) {
        if let Some(e) = self.engines.get(usize::from(engine)) {
            let bits = usage.map_or(u64::MAX, |u| u.clamp(0.0, 1.0).to_bits());
            e.kv_usage_bits.store(bits, Ordering::Relaxed);
        }
    }

    /// The KV cache usage `engine` last reported (0..1).
    pub fn kv_usage(&self, engine: u16) -> Option<f64> {
        let b = self
            .engines
            .get(usize::from(engine))?
            .kv_usage_bits
            .load(Ordering::Relaxed);
        (b != u64::MAX).then(|| f64::from_bits(b))
    }

    /// In-flight decode streams on `engine`.
    pub fn inflight_decode_streams(&self, engine: u16) -> u32 {
        self.engines
            .get(usize::from(engine))
            .map_or(0, |e| e.inflight_decode_streams.load(Ordering::Relaxed))
    }

    /// Measured prefill cost of `engine`, ms per token (`None` before the
    /// first sample).
    pub fn measured_ms_per_token(&self, engine: u16) -> Option<f64> {
        let bits = self
            .engines
            .get(usize::from(engine))?
            .ms_per_token_bits
            .load(Ordering::Relaxed);
        (bits != 0).then(|| f64::from_bits(bits))
    }
}

#[cfg(test)]
#[path = "load_tests.rs"]
mod tests;
