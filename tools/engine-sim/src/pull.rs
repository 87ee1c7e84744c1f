//! The READ side of an engine: turning the params a request carries into a
//! [`ReadRequest`], performing it through the engine's [`crate::KvTransfer`],
//! and logging and counting the outcome (a failure means a local recompute).
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvloop_router_api::{BlockIds, KvTransferParams, ParamsError};
use serde_json::Value;
use tracing::warn;

use crate::engine::Engine;
use crate::kv::VerifyOutcome;
use crate::stats::ReadLogEntry;
use crate::transfer::ReadRequest;

/// What a pull did.
pub(crate) struct Pulled {
    /// Tokens read (0: nothing; recompute).
    pub(crate) reused: u64,
    /// The verification of the READ blocks, running.
    pub(crate) verify: Option<tokio::task::JoinHandle<VerifyOutcome>>,
    /// The READ was abandoned and may still write the destination blocks:
    /// the caller computes into fresh blocks ([`Engine::park_blocks`]).
    pub(crate) abandoned: bool,
}

impl Engine {
    /// Try to READ the KV the params describe; returns the tokens reused (0 on
    /// any failure) and, with real KV, the pending verification of the READ blocks.
    pub(crate) async fn pull(
        &self,
        request_id: &str,
        params: Option<&Value>,
        tokens: &Arc<Vec<u32>>,
        expect_from_decode: bool,
        local_block_ids: &[u32],
    ) -> Pulled {
        let (r, abandoned) = self
            .pull_inner(
                request_id,
                params,
                tokens,
                expect_from_decode,
                local_block_ids,
            )
            .await;
        if r == 0 {
            return Pulled {
                reused: 0,
                verify: None,
                abandoned,
            };
        }
        let verify = self.kv.clone().map(|kv| {
            let ids = local_block_ids.to_vec();
            let tokens = tokens.clone();
            tokio::task::spawn_blocking(move || kv.verify_tokens(&ids, &tokens, r as usize))
        });
        Pulled {
            reused: r,
            verify,
            abandoned: false,
        }
    }

    async fn pull_inner(
        &self,
        request_id: &str,
        params: Option<&Value>,
        tokens: &Arc<Vec<u32>>,
        expect_from_decode: bool,
        local_block_ids: &[u32],
    ) -> (u64, bool) {
        let prompt_tokens = tokens.len() as u64;
        let Some(mut req) = self.wanted_read(params, prompt_tokens, expect_from_decode) else {
            return (0, false);
        };
        let n_local = self.blocks_for(req.num_tokens).min(local_block_ids.len());
        req.local_block_ids = local_block_ids[..n_local].to_vec();
        let want_tokens = req.num_tokens;
        let start = Instant::now();
        let result = self.transfer.read(req).await;
        let elapsed = start.elapsed();
        let mut entry = ReadLogEntry {
            request_id: request_id.to_string(),
            direction: if expect_from_decode { "d2p" } else { "p2d" }.into(),
            prompt_tokens,
            tokens: 0,
            bytes: 0,
            transfer_ms: elapsed.as_secs_f64() * 1e3,
            verified_blocks: 0,
            mismatched_blocks: 0,
            error: None,
        };
        let out = match result {
            Ok(n) => {
                self.stats.reads_ok.fetch_add(1, Ordering::Relaxed);
                let bytes = self
                    .kv
                    .as_ref()
                    .map(|kv| self.blocks_for(want_tokens) as u64 * kv.bytes_per_block())
                    .unwrap_or(0);
                self.metrics
                    .xfer_time_seconds
                    .observe(elapsed.as_secs_f64());
                self.metrics.xfer_bytes.observe(bytes as f64);
                entry.tokens = n;
                entry.bytes = bytes;
                (n, false)
            }
            Err(e) => {
                warn!(engine = %self.cfg.engine_id, error = %e, "READ not done; recomputing locally");
                self.stats.reads_declined.fetch_add(1, Ordering::Relaxed);
                self.metrics.failed_transfers.inc();
                entry.error = Some(e.to_string());
                (0, e.may_still_write())
            }
        };
        self.log_read(entry);
        out
    }

    /// The READ the params ask for, or `None` when there is nothing to read:
    /// no params, the wrong direction's flag, the "no reuse" shape, invalid
    /// params (counted, warned), or fewer tokens than the recompute threshold.
    fn wanted_read(
        &self,
        params: Option<&Value>,
        prompt_tokens: u64,
        expect_from_decode: bool,
    ) -> Option<ReadRequest> {
        let p = params?;
        let flag = if expect_from_decode {
            "do_remote_decode"
        } else {
            "do_remote_prefill"
        };
        if p.get(flag).and_then(Value::as_bool) != Some(true) {
            return None;
        }
        if p.get("remote_block_ids").is_none_or(Value::is_null) {
            return None; // the "no reuse" shape
        }
        let req = match self.read_request(p, prompt_tokens, expect_from_decode) {
            Ok(r) => r,
            Err(e) => {
                warn!(engine = %self.cfg.engine_id, error = %e, "invalid kv_transfer_params; recomputing locally");
                self.stats.invalid_params.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        if req.num_tokens == 0 || req.num_tokens < self.cfg.kv_recompute_threshold_tokens {
            return None;
        }
        Some(req)
    }

    /// The READ of typed params ([`KvTransferParams`], the protocol
    /// crate's parser: the router and the engines read params one way).
    ///
    /// # Errors
    /// The [`ParamsError`] naming the first bad field; `remote_host` must be
    /// a non-empty string here, and `remote_num_tokens` present on D→P.
    fn read_request(
        &self,
        p: &Value,
        prompt_tokens: u64,
        from_decode: bool,
    ) -> Result<ReadRequest, ParamsError> {
        let kv = KvTransferParams::parse(&p.to_string())?;
        let host = kv
            .remote_host
            .filter(|h| !h.is_empty())
            .ok_or(ParamsError {
                field: "remote_host",
                expected: "a non-empty string",
            })?;
        let num_tokens = if from_decode {
            // D→P: count = min(remote_num_tokens, prompt_tokens); nothing cached locally.
            kv.remote_num_tokens
                .ok_or(ParamsError {
                    field: "remote_num_tokens",
                    expected: "a non-negative integer (D's held tokens)",
                })?
                .min(prompt_tokens)
        } else {
            kv.remote_num_tokens
                .unwrap_or(prompt_tokens)
                .min(prompt_tokens)
        };
        let remote_block_ids = match kv.remote_block_ids {
            BlockIds::Grouped(g) => g.into_iter().flatten().collect(),
            BlockIds::Flat(f) => f,
        };
        Ok(ReadRequest {
            reader_engine_id: self.cfg.engine_id.clone(),
            remote_engine_id: kv.remote_engine_id,
            remote_host: host,
            remote_port: kv.remote_port,
            remote_request_id: kv.remote_request_id,
            remote_block_ids,
            num_tokens,
            local_block_ids: Vec::new(),
            block_size_tokens: self.cfg.block_size_tokens,
        })
    }
}
