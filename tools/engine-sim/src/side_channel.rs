//! The server end of the engine's HTTP side channel (`POST /kv/read`): a
//! reader's claim of this engine's held blocks.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::config::KvMode;
use crate::engine::Engine;

/// A reader's claim (`POST /kv/read`).
#[derive(Deserialize)]
pub(crate) struct SideRead {
    remote_request_id: String,
    block_ids: Vec<u32>,
    num_tokens: u64,
    /// Real KV: keep the blocks until the reader's owner notification (or
    /// the read deadline) and answer with the transfer engine's address.
    #[serde(default)]
    defer_release: bool,
}

/// Side channel: a reader's READ of this engine's held blocks. Serves it when
/// the hold exists, covers the blocks and tokens, and does not expire within
/// the safety margin; the READ doubles as the owner notification (the hold is
/// freed), so params are single use.
pub(crate) async fn side_read(State(e): State<Arc<Engine>>, Json(r): Json<SideRead>) -> Response {
    let now = Instant::now();
    let mut holds = e.holds.lock();
    let refuse = |msg: String| {
        e.stats.side_reads_refused.fetch_add(1, Ordering::Relaxed);
        (StatusCode::GONE, msg).into_response()
    };
    let Some(h) = holds.get(&r.remote_request_id) else {
        return refuse(format!(
            "request {}: no blocks held (read already, expired or unknown)",
            r.remote_request_id
        ));
    };
    if h.expires_at <= now + Duration::from_millis(e.cfg.expiry_margin_ms) {
        return refuse(format!(
            "request {}: blocks expire within the safety margin",
            r.remote_request_id
        ));
    }
    if r.block_ids != h.block_ids || r.num_tokens > h.num_tokens {
        return refuse(format!(
            "request {}: block ids or token count do not match the hold",
            r.remote_request_id
        ));
    }
    if r.defer_release {
        let Some(kv) = e.kv.as_ref().filter(|k| k.transfer_engine().is_some()) else {
            return refuse(format!(
                "request {}: defer_release needs kv_mode inproc; this engine is in kv_mode {}",
                r.remote_request_id,
                match e.cfg.kv_mode {
                    KvMode::None => "none",
                    KvMode::Inproc => "inproc",
                    KvMode::Agent => "agent (READ through the node agents)",
                }
            ));
        };
        let mut h = holds.remove(&r.remote_request_id).expect("checked above");
        drop(holds);
        // Freed by the owner notification; the deadline covers a reader that died.
        h.expires_at =
            now + Duration::from_millis(e.cfg.kv_read_timeout_ms + e.cfg.expiry_margin_ms);
        e.reading.lock().insert(r.remote_request_id.clone(), h);
        e.stats.side_reads_served.fetch_add(1, Ordering::Relaxed);
        return Json(json!({
            "dataplane_addr": kv.dataplane_addr().to_string(),
            "engine_id": e.cfg.engine_id,
        }))
        .into_response();
    }
    let h = holds.remove(&r.remote_request_id).expect("checked above");
    drop(holds);
    e.alloc.lock().release(&h.block_ids);
    e.stats.side_reads_served.fetch_add(1, Ordering::Relaxed);
    StatusCode::OK.into_response()
}
