//! Pull notices: when a managed READ of D's blocks ends, every router
//! address hears of it at once ([`kvloop_router_api::PullNotice`]).
//! * Without the blocks (abandoned as slower than recomputing, failed, or
//!   declined by D's lease: `POST` [`kvloop_router_api::PULL_ABANDONED_PATH`]),
//!   P recomputes the whole prompt.
//! * With them (`POST` [`kvloop_router_api::PULL_READ_PATH`]), P's engine
//!   queues the turn's suffix.
//!
//! Either way the replica that sent the turn counts P's compute line from
//! now rather than guessing until P answers. One attempt per address: a
//! notice is worth something only while P holds the turn. Addresses as the
//! threshold pushes resolve them ([`super::push::targets`]).
use std::sync::Arc;
use std::time::Duration;

use kvloop_router_api::PullNotice;

use super::push::{Sent, send_json};
use crate::agent::Agent;
use crate::metrics::labels;

/// Sends each queued notice to every router address, each POST in its own
/// task (a router that is down delays no other). A READ completes for every
/// pulled turn, so the addresses are resolved at most once per
/// `push_period_ms` ([`super::push::TargetCache`]), not per notice.
pub async fn run(agent: Arc<Agent>) {
    let Some(mut rx) = agent.take_pull_notices() else {
        return;
    };
    let period = Duration::from_millis(agent.config().push_period_ms.max(1));
    let mut addresses = super::push::TargetCache::new(agent.config().routers.len(), period);
    while let Some(n) = rx.recv().await {
        let n = Arc::new(n);
        for (i, r) in agent.config().routers.iter().enumerate() {
            for url in addresses.get(i, r).await.iter() {
                let (agent, n, token, url) =
                    (agent.clone(), n.clone(), r.token.clone(), url.clone());
                tokio::spawn(async move {
                    send_one(&agent, &url, token.as_deref(), &n).await;
                });
            }
        }
    }
}

async fn send_one(agent: &Agent, base: &str, token: Option<&str>, n: &PullNotice) {
    let url = format!("{}{}", base.trim_end_matches('/'), n.path());
    let ok = match send_json(agent, reqwest::Method::POST, &url, token, n).await {
        Sent::Ok => true,
        Sent::Refused(st, body) => {
            tracing::warn!(router = %base, status = %st, %body, cause = %n.cause, "pull notice refused");
            false
        }
        Sent::Failed(e) => {
            tracing::debug!(router = %base, error = %e, cause = %n.cause, "pull notice failed");
            false
        }
    };
    agent
        .metrics()
        .pull_notices
        .get_or_create(&labels(&[
            ("router", base),
            (
                "notice",
                if n.cause == PullNotice::READ {
                    "read"
                } else {
                    "abandoned"
                },
            ),
            ("result", if ok { "ok" } else { "error" }),
        ]))
        .inc();
}
