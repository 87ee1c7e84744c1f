//! KV-cache-aware P/D router, drop-in for vLLM's multi-turn disaggregated proxy.
//!
//! Every turn goes P (prefill, `max_tokens: 1`) → D (decode, the client's
//! request with P's `kv_transfer_params`). D's returned params are kept per
//! (tenant, `conversation_id`) and, on the next turn, attached to P's request
//! when the new prompt extends what D holds and the reusable token count
//! passes the (pushed or static) recompute threshold. See
//! `docs/protocol.md`, "Router rules".
//!
//! Layout: the decision logic is pure and unit-tested ([`params`],
//! [`fingerprint`], [`store`], [`thresholds`], [`decision`], [`sse`],
//! [`request`], [`alarms`], [`registry`], [`config`], [`select`],
//! [`warmup`]); the shell is
//! [`server`] (state, app, one request's walk), [`upstream`] (engine calls
//! and their error), [`relay`] (D's stream to the client, storing turns),
//! [`admin`] (the router's own endpoints), [`error`] and [`clock`].
#![forbid(unsafe_code)]

pub mod admin;
pub mod alarms;
pub mod clock;
pub mod config;
pub mod decision;
pub mod error;
pub mod explain;
pub mod fingerprint;
pub mod health;
pub mod load_poll;
pub mod load_share;
pub mod metrics;
pub mod models;
pub mod params;
pub mod prefill;
pub mod reason;
pub mod registry;
pub mod relay;
pub mod request;
pub mod retention;
pub mod retention_task;
pub mod select;
pub mod server;
pub mod sse;
pub mod state;
pub mod store;
pub mod thresholds;
pub mod token_ids;
pub mod upstream;
pub mod warmup;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::serve::ListenerExt;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use config::RouterConfig;
pub use server::AppState;

/// A router serving on a bound address.
pub struct RunningRouter {
    /// Bound address.
    pub addr: SocketAddr,
    /// Shared state (metrics, store).
    pub state: Arc<AppState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl RunningRouter {
    /// Base URL, e.g. `http://127.0.0.1:8000`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for RunningRouter {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Bind `cfg.listen`, start serving and the background tasks on the current
/// tokio runtime.
///
/// # Errors
/// Invalid config, or the address cannot be bound.
pub async fn start(cfg: RouterConfig, clock: Box<dyn Clock>) -> anyhow::Result<RunningRouter> {
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding listen {}: {e}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let state = AppState::new(cfg, clock)?;
    server::spawn_background(&state);
    let app = server::app(state.clone());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(
            listener.tap_io(|t| {
                let _ = t.set_nodelay(true);
            }),
            app,
        )
        .with_graceful_shutdown(async move {
            let _ = rx.await;
        })
        .await;
    });
    Ok(RunningRouter {
        addr,
        state,
        shutdown: Some(tx),
    })
}
