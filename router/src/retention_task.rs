//! The I/O of decode-side retention ([`crate::retention`]): the hooks the
//! request path and the store call, the task that sends decisions to the
//! agents (`POST /v1/leases/retention`, the router's `admin_token` as
//! bearer, three tries with back-off on transport errors and 5xx: a release
//! is sent at least once, and agents treat a repeat as a no-op), the tick
//! that renews or releases followed holds, and
//! `DELETE /v1/conversations/{id}`.
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use backon::{ExponentialBuilder, Retryable};
use kvloop_agent_api::peer::{API_VERSION, RETENTION_PATH, RetentionAnswer, RetentionRequest};
use tracing::debug;

use crate::error::error_response;
use crate::metrics::RetentionLabels;
use crate::retention::{Cause, Job};
use crate::state::AppState;
use crate::store::{ConvKey, DropCause, Dropped, Lookup, StoredTurn};

/// Decisions queued at most; beyond, a decision is counted `dropped` (D's
/// own TTL still bounds the hold).
pub const QUEUE: usize = 4096;
/// Decisions sent at once.
const IN_FLIGHT: usize = 16;
/// Period of the renew / release tick, ms.
const TICK_MS: u64 = 250;
/// Timeout of one POST to an agent, ms.
const POST_TIMEOUT_MS: u64 = 2_000;

impl AppState {
    fn count_retention(&self, j: &Job, result: &'static str) {
        let now = self.now_ms();
        self.retention.lock().record(j, result, now);
        self.metrics
            .retention
            .get_or_create(&RetentionLabels {
                action: if j.keep_ms == 0 { "release" } else { "keep" },
                cause: j.cause.as_str(),
                result,
            })
            .inc();
    }

    /// Queues `job` (or counts it: no agent known, queue full, no task).
    fn send_retention(&self, job: Job) {
        if job.agent_url.is_none() {
            self.count_retention(&job, "unmanaged");
            return;
        }
        match self.retention_jobs.get() {
            Some(tx) => {
                if let Err(e) = tx.try_send(job) {
                    let j = match e {
                        tokio::sync::mpsc::error::TrySendError::Full(j)
                        | tokio::sync::mpsc::error::TrySendError::Closed(j) => j,
                    };
                    self.count_retention(&j, "dropped");
                }
            }
            None => self.count_retention(&job, "dropped"),
        }
    }

    /// A stored turn nobody will pull: tell D's agent to release its hold.
    pub(crate) fn release_turn(&self, key: &ConvKey, turn: &StoredTurn, cause: Cause) {
        let d = self.engine_id(turn.decode_engine);
        let job = self.retention.lock().release(key, &d, turn, cause);
        if let Some(j) = job {
            self.send_retention(j);
        }
    }

    /// The next turn of `key` took its stored turn (the gap is observed).
    pub(crate) fn retention_taken(&self, key: &ConvKey, turn: &StoredTurn, now_ms: u64) {
        let now_unix = crate::clock::unix_ms();
        self.retention
            .lock()
            .taken(key, now_ms, turn.stored_at_unix_ms, now_unix);
    }

    /// A turn is being stored: its first lease (adaptive mode). The TTFT it
    /// saves: recomputing `remote_num_tokens` on P less the READ, by the
    /// pair's confident pushed cost model when there is one, else
    /// `retention.prefill_ms_per_token` per token.
    pub(crate) fn retention_stored(
        &self,
        key: &ConvKey,
        turn: &StoredTurn,
        prefill: u16,
        now_ms: u64,
    ) {
        let d = self.engine_id(turn.decode_engine);
        if !self.retention.lock().leases(&d) {
            return;
        }
        let tokens = u64::from(turn.remote_num_tokens);
        let saved_ms = self
            .thresholds
            .lock()
            .effective(&self.engine_id(prefill), &d, now_ms)
            .saved_by_pull_ms(tokens)
            .unwrap_or(tokens as f64 * self.cfg.retention.prefill_ms_per_token);
        let job = self
            .retention
            .lock()
            .stored(key, &d, turn, saved_ms, now_ms);
        if let Some(j) = job {
            self.send_retention(j);
        }
    }

    /// Renews or releases the followed holds whose lease ended; a released
    /// one's turn leaves the store (its next turn recomputes at once
    /// instead of trying a READ the agent would decline).
    pub(crate) async fn retention_tick(&self) {
        let now = self.now_ms();
        let kv_usage = |d: &str| {
            self.registry
                .index_of(d)
                .and_then(|i| self.load.kv_usage(i))
        };
        let (due, followed) = {
            let mut r = self.retention.lock();
            (r.due(now, kv_usage), r.followed())
        };
        self.metrics.retention_followed.set(followed as i64);
        for (key, job) in due {
            if job.keep_ms == 0
                && let Lookup::Found(t) = self.store.take_or_missing(&key, now).await
                && t.params.remote_request_id().as_deref() != Some(job.request_id.as_str())
            {
                // A newer turn (stored by another replica): not ours to drop.
                self.store.insert_or_count(key.clone(), t, now).await;
            }
            self.send_retention(job);
        }
    }

    /// POSTs `job` to its agent (three tries on transport errors and 5xx):
    /// the agent's answer, or `None` when it answered 404 (no agent hosts
    /// that engine: stock vLLM behind an agent).
    async fn post_retention(&self, job: &Job) -> Result<Option<RetentionAnswer>, String> {
        let url = format!(
            "{}{RETENTION_PATH}",
            job.agent_url.as_deref().unwrap_or_default()
        );
        let body = RetentionRequest {
            version: API_VERSION,
            engine_id: job.decode_engine_id.clone(),
            request_id: job.request_id.clone(),
            keep_ms: job.keep_ms,
            forwarded: false,
        };
        let send = || async {
            let mut req = self
                .upstream
                .http
                .post(&url)
                .json(&body)
                .timeout(Duration::from_millis(POST_TIMEOUT_MS));
            if !self.cfg.admin_token.is_empty() {
                req = req.bearer_auth(&self.cfg.admin_token);
            }
            let resp = req.send().await.map_err(|e| (true, e.to_string()))?;
            let status = resp.status();
            if status.is_success() {
                return resp
                    .json::<RetentionAnswer>()
                    .await
                    .map(Some)
                    .map_err(|e| (false, e.to_string()));
            }
            if status == reqwest::StatusCode::NOT_FOUND {
                return Ok(None);
            }
            let text = resp.text().await.unwrap_or_default();
            Err((status.is_server_error(), format!("HTTP {status}: {text}")))
        };
        send.retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(Duration::from_secs(1))
                .with_max_times(2),
        )
        .when(|(retry, _)| *retry)
        .await
        .map_err(|(_, e)| format!("{url}: {e}"))
    }

    async fn run_job(&self, job: Job) {
        let result = match self.post_retention(&job).await {
            Ok(Some(RetentionAnswer::Released { .. })) => "released",
            Ok(Some(RetentionAnswer::Deferred { .. })) => "deferred",
            Ok(Some(RetentionAnswer::Kept { .. })) => "kept",
            Ok(Some(RetentionAnswer::Unknown)) => {
                // Nothing held there any more (its next turn, on another
                // replica, read it; or it expired): stop renewing it.
                self.retention.lock().forget(&job.key, &job.request_id);
                "unknown"
            }
            Ok(None) => {
                let now = self.now_ms();
                self.retention
                    .lock()
                    .mark_unmanaged(&job.decode_engine_id, now);
                "unmanaged"
            }
            Err(e) => {
                debug!(engine_id = %job.decode_engine_id, request_id = %job.request_id, error = %e, "retention decision not applied");
                "error"
            }
        };
        self.count_retention(&job, result);
    }
}

fn cause_of(c: DropCause) -> Cause {
    match c {
        DropCause::Lru => Cause::Lru,
        DropCause::Expired => Cause::Expired,
        DropCause::Replaced => Cause::Replaced,
    }
}

/// Starts the retention tasks of `state` (they end when it is dropped):
/// the store's dropped turns become releases, decisions are sent
/// ([`IN_FLIGHT`] at once), and followed holds are renewed or released
/// every 250 ms (at D's KV usage, which `crate::load_poll` reads).
pub fn spawn(state: &Arc<AppState>) {
    let (drop_tx, mut drop_rx) = tokio::sync::mpsc::channel::<Dropped>(QUEUE);
    state.store.set_drop_sink(drop_tx);
    let (job_tx, mut job_rx) = tokio::sync::mpsc::channel::<Job>(QUEUE);
    let _ = state.retention_jobs.set(job_tx);
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        while let Some(d) = drop_rx.recv().await {
            let Some(s) = weak.upgrade() else { break };
            s.release_turn(&d.key, &d.turn, cause_of(d.cause));
        }
    });
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let permits = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
        while let Some(job) = job_rx.recv().await {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let Some(s) = weak.upgrade() else { break };
            tokio::spawn(async move {
                s.run_job(job).await;
                drop(permit);
            });
        }
    });
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(TICK_MS)).await;
            let Some(s) = weak.upgrade() else { break };
            s.retention_tick().await;
        }
    });
}

/// `DELETE /v1/conversations/{id}`: the conversation ended. Its stored turn
/// (of the request's tenant: the `tenant_header`, as for completions)
/// leaves the store and D's hold is released at once. `Authorization:
/// Bearer <admin_token>` when the router has one. `204` when a turn was
/// stored, `404` when none was.
pub async fn delete_conversation(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !s.cfg.admin_token.is_empty() && !crate::admin::authorized(&s, &headers) {
        return crate::admin::unauthorized();
    }
    if id.is_empty() || id.len() > 1024 {
        return error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("conversation_id"),
            "conversation_id: expected 1..=1024 bytes",
        );
    }
    let tenant = crate::request::tenant_of(&headers, &s.cfg.tenant_header, &s.cfg.default_tenant);
    let key = ConvKey::new(&tenant, &id);
    let now = s.now_ms();
    match s.store.take_or_missing(&key, now).await {
        Lookup::Found(turn) => {
            s.release_turn(&key, &turn, Cause::Ended);
            StatusCode::NO_CONTENT.into_response()
        }
        _ => error_response(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("conversation_id"),
            format!("conversation `{id}` of tenant `{tenant}`: nothing stored"),
        ),
    }
}
