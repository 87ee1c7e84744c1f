//! Router replicas share their prefill lines through the shared store
//! (issue 13: `queue(P)` across replicas). Every `load_share_interval_ms`,
//! under `policy = "predicted_ttft"` with a Redis store, this replica
//! writes its outstanding prefills per prefill engine (age, predicted
//! compute: [`crate::select::load::LoadBook::own_line`]) to the hash
//! `<store_key_prefix>:load` and reads every other replica's, in one
//! pipeline; the selection's `queue(P)` then merges them with its own
//! ([`crate::select::load::LoadBook::remaining_ms`]). The format and the
//! merge are pure ([`crate::select::share`]). A replica that stops sharing
//! is forgotten after `LOAD_SHARE_MAX_AGE_PERIODS` periods (its field is
//! deleted); when the store fails, the shared lines are cleared and
//! `queue(P)` falls back to this replica's own line and P's polled report.
//! Each exchange also ranks this replica among the live ones, which sets
//! where its round-robin tie-breaks start (`AppState::rr_offset`, `/health`'s `replicas`,
//! [`crate::select::share::tie_offset`]).
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::unix_ms;
use crate::config::Policy;
use crate::select::load::SharedLine;
use crate::select::share::{self, LoadShare, SHARE_VERSION};
use crate::state::AppState;

/// Periods after which another replica's share no longer counts.
pub const LOAD_SHARE_MAX_AGE_PERIODS: u64 = 10;

/// This replica's id in the shared hash: host, process and a random part
/// (a restarted replica is a new one; its old field ages out).
pub fn replica_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "router".into());
    let nonce = std::collections::hash_map::RandomState::new();
    let r = std::hash::BuildHasher::hash_one(&nonce, std::process::id());
    format!("{host}-{}-{:08x}", std::process::id(), r as u32)
}

impl AppState {
    /// This replica's share now.
    fn own_share(&self) -> LoadShare {
        let now = self.now_ms();
        let engines = self
            .prefill_idx
            .iter()
            .filter_map(|&i| {
                let id = self.registry.get(i)?.engine_id.clone();
                let line = self.load.own_line(i, now)?;
                Some((id, line))
            })
            .collect();
        LoadShare {
            v: SHARE_VERSION,
            sent_unix_ms: unix_ms(),
            engines,
        }
    }

    /// One exchange: writes this replica's share, reads the others', and
    /// sets the load book's shared lines (cleared on failure). Returns the
    /// fields of replicas that stopped sharing, to delete next time.
    pub async fn exchange_load(&self, replica: &str, forget: &[String]) -> Vec<String> {
        let period_ms = self.cfg.load_share_interval_ms.max(1);
        let max_age_ms = period_ms * LOAD_SHARE_MAX_AGE_PERIODS;
        let mine = share::encode(&self.own_share());
        let got = self
            .store
            .exchange_load(replica, mine, max_age_ms.max(10_000), forget)
            .await;
        let (now, now_unix) = (self.now_ms(), unix_ms());
        // A failed exchange keeps the last rank (the replicas still differ).
        let got_ok = got.is_ok();
        let mut stale = Vec::new();
        let mut live: Vec<String> = Vec::new();
        let merged: BTreeMap<String, SharedLine> = match got {
            Ok(Some(all)) => {
                let mut shares = Vec::with_capacity(all.len());
                for (field, bytes) in all {
                    if field == replica {
                        continue;
                    }
                    match share::decode(&bytes) {
                        Ok(s) if share::is_stale(s.sent_unix_ms, now_unix, max_age_ms) => {
                            stale.push(field)
                        }
                        Ok(s) => {
                            live.push(field);
                            shares.push(s)
                        }
                        Err(e) => {
                            tracing::debug!(replica = %field, error = %e, "load share ignored");
                            stale.push(field);
                        }
                    }
                }
                share::merge(&shares, now, now_unix, max_age_ms)
            }
            Ok(None) => BTreeMap::new(),
            Err(e) => {
                tracing::debug!(error = %e, "load share failed: own line and P's report only");
                BTreeMap::new()
            }
        };
        if got_ok {
            self.set_replica_rank(share::replica_rank(
                replica,
                live.iter().map(String::as_str),
            ));
        }
        for &i in &self.prefill_idx {
            let line = self
                .registry
                .get(i)
                .and_then(|e| merged.get(&e.engine_id))
                .cloned()
                .unwrap_or_default();
            self.load.set_shared_line(i, line);
        }
        stale
    }
}

/// Spawns the exchange of `state` (none unless the policy predicts, the
/// store is shared and `load_share_interval_ms` > 0); it ends when the
/// state is dropped.
pub fn spawn(state: &Arc<AppState>) {
    if state.cfg.policy != Policy::PredictedTtft
        || !state.store.is_shared()
        || state.cfg.load_share_interval_ms == 0
    {
        return;
    }
    let weak = Arc::downgrade(state);
    let period = Duration::from_millis(state.cfg.load_share_interval_ms.max(1));
    let replica = replica_id();
    tracing::info!(%replica, period_ms = period.as_millis() as u64, "sharing prefill lines with the other replicas");
    tokio::spawn(async move {
        let mut forget: Vec<String> = Vec::new();
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { break };
            forget = s.exchange_load(&replica, &forget).await;
        }
    });
}
