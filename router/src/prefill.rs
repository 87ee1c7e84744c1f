//! The prefill step of a turn: the retry-once rule and P's params for D.
use std::time::Duration;

use kvloop_router_api::json::to_raw;
use serde_json::value::RawValue;
use tracing::warn;

use crate::alarms::PullOutcome;
use crate::decision::Decision;
use crate::error::RouteError;
use crate::params::{KvParams, no_reuse_prefill_params};
use crate::request::{ParsedRequest, prefill_body};
use crate::state::AppState;
use crate::upstream::{Failure, PrefillReply, Stage, Upstream, UpstreamError};

/// The prefill step with the retry-once rule: when D's params were attached
/// and the failure is retry-safe, once more without them, on the next
/// healthy prefill engine when there is another one. Returns P's index and
/// answer; records the pull's outcome. `pull_failed` runs when P failed
/// with D's params attached (D's hold will not be read: released).
pub(crate) async fn prefill(
    s: &AppState,
    req: &ParsedRequest,
    mut p_idx: u16,
    decision: &Decision,
    n_prompt: Option<usize>,
    request_id: &str,
    pull_failed: impl FnOnce(),
) -> Result<(u16, PrefillReply), UpstreamError> {
    let no_reuse = || to_raw(&no_reuse_prefill_params());
    let holder = decision
        .decode_engine_id
        .as_deref()
        .and_then(|d| s.registry.index_of(d));
    let send = |p_idx: u16, params: Box<RawValue>, reused: u64| {
        send_prefill(
            &s.upstream,
            s,
            req,
            p_idx,
            params,
            n_prompt,
            reused,
            request_id,
        )
    };
    let Some(attach) = decision.attach.clone() else {
        return send(p_idx, no_reuse(), 0).await.map(|r| (p_idx, r));
    };
    let holder = holder.expect("attached params name a registered D");
    match send(p_idx, attach, decision.reused_tokens).await {
        Ok(r) => {
            let outcome = PullOutcome::classify(decision.reused_tokens, r.reported_reused);
            s.record_pull(p_idx, holder, outcome);
            Ok((p_idx, r))
        }
        Err(e) => {
            s.record_pull(p_idx, holder, PullOutcome::Failed);
            pull_failed();
            if !e.retry_safe() {
                warn!(%request_id, error = %e, "prefill with D's params refused; not retried");
                return Err(e);
            }
            warn!(%request_id, error = %e, "prefill failed with D's params attached; retrying once without them");
            s.metrics.prefill_retries.inc();
            if let Some(next) = s.pick(&s.prefill_idx, &s.rr_prefill) {
                p_idx = next;
            }
            send(p_idx, no_reuse(), 0).await.map(|r| (p_idx, r))
        }
    }
}

/// The prefill request to P `p_idx` with `params` as its
/// `kv_transfer_params`; `reused` tokens are not P's to compute.
#[allow(clippy::too_many_arguments)]
fn send_prefill<'a>(
    up: &'a Upstream,
    s: &'a AppState,
    req: &'a ParsedRequest,
    p_idx: u16,
    params: Box<RawValue>,
    n_prompt: Option<usize>,
    reused: u64,
    request_id: &'a str,
) -> impl std::future::Future<Output = Result<PrefillReply, UpstreamError>> + 'a {
    let p = s.registry.get(p_idx).expect("index");
    up.prefill(
        &p.engine_id,
        crate::upstream::api_url(p, req.api),
        request_id,
        prefill_body(&req.members, &params),
        n_prompt.map(|n| (n, reused)),
        Duration::from_millis(s.cfg.prefill_timeout_ms),
    )
}

/// The prefill step again, without reuse, for a turn whose decode request
/// never got D's answer ([`crate::server`]'s decode retry): P computes the
/// whole prompt into fresh blocks, so D's second request READs only blocks
/// of this prefill, never the first prefill's (which P may have freed after
/// a READ of D's first request, or may still hold until its lease lapses).
/// On a new connection ([`Upstream::fresh_connections`]).
pub(crate) async fn prefill_again(
    s: &AppState,
    req: &ParsedRequest,
    p_idx: u16,
    n_prompt: Option<usize>,
    request_id: &str,
) -> Result<PrefillReply, UpstreamError> {
    let params = to_raw(&no_reuse_prefill_params());
    let up = s.upstream.fresh_connections();
    // Outstanding on P until it answers (no prediction: counted, not costed).
    let _load = s
        .load
        .begin_prefill(p_idx, n_prompt.unwrap_or(0) as u64, None, None, None, 0);
    send_prefill(&up, s, req, p_idx, params, n_prompt, 0, request_id).await
}

/// P's params for D, with `remote_host` from the registry.
pub(crate) fn params_for_decode(
    s: &AppState,
    p_idx: u16,
    reply: PrefillReply,
) -> Result<Box<RawValue>, RouteError> {
    let p = s.registry.get(p_idx).expect("index");
    let body_err = |detail: String| {
        s.metrics.reject_params("source_prefill");
        RouteError::Upstream(UpstreamError::new(
            Stage::Prefill,
            &p.engine_id,
            Failure::Body,
            detail,
        ))
    };
    let raw = reply.params.ok_or_else(|| {
        body_err("kv_transfer_params: missing in its response (is it a kv_producer?)".into())
    })?;
    let params = KvParams::parse_json(raw.get()).map_err(|e| body_err(e.to_string()))?;
    let Some(emitter) = s
        .registry
        .index_of(&params.remote_engine_id)
        .and_then(|i| s.registry.get(i))
    else {
        s.metrics.reject_params("unknown_engine");
        return Err(RouteError::Upstream(UpstreamError::new(
            Stage::Prefill,
            &p.engine_id,
            Failure::Body,
            format!(
                "kv_transfer_params.remote_engine_id: engine {:?} is not in the registry",
                params.remote_engine_id
            ),
        )));
    };
    Ok(params.to_request_json(&emitter.side_channel_host, false, true))
}
