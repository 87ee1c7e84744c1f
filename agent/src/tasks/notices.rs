//! Abandoned-pull notices: when a managed READ of D's blocks ends without
//! them (abandoned as slower than recomputing, failed, or declined by D's lease), P recomputes the
//! whole prompt; every router address hears of it at once
//! (`POST` [`kvloop_router_api::PULL_ABANDONED_PATH`]), so that the replica
//! that sent the turn counts P busy with that recompute now rather than
//! when P answers. One attempt per address: a notice is worth something
//! only while P recomputes. Addresses as the threshold pushes resolve them
//! ([`super::push::targets`]).
use std::sync::Arc;

use kvloop_router_api::{PULL_ABANDONED_PATH, PullAbandoned};

use super::push::{Sent, send_json};
use crate::agent::Agent;
use crate::metrics::labels;

/// Sends each queued notice to every router address, each POST in its own
/// task (a router that is down delays no other).
pub async fn run(agent: Arc<Agent>) {
    let Some(mut rx) = agent.take_pull_notices() else {
        return;
    };
    while let Some(n) = rx.recv().await {
        let n = Arc::new(n);
        for r in &agent.config().routers {
            for url in super::push::targets(r).await {
                let (agent, n, token) = (agent.clone(), n.clone(), r.token.clone());
                tokio::spawn(async move {
                    send_one(&agent, &url, token.as_deref(), &n).await;
                });
            }
        }
    }
}

async fn send_one(agent: &Agent, base: &str, token: Option<&str>, n: &PullAbandoned) {
    let url = format!("{}{}", base.trim_end_matches('/'), PULL_ABANDONED_PATH);
    let ok = match send_json(agent, reqwest::Method::POST, &url, token, n).await {
        Sent::Ok => true,
        Sent::Refused(st, body) => {
            tracing::warn!(router = %base, status = %st, %body, "abandoned-pull notice refused");
            false
        }
        Sent::Failed(e) => {
            tracing::debug!(router = %base, error = %e, "abandoned-pull notice failed");
            false
        }
    };
    agent
        .metrics()
        .pull_notices
        .get_or_create(&labels(&[
            ("router", base),
            ("result", if ok { "ok" } else { "error" }),
        ]))
        .inc();
}
