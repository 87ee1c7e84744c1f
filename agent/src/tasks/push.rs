//! Threshold pushes: every router gets the agent's pair thresholds every
//! push period, and at once after a path invalidation.
use std::sync::Arc;
use std::time::Duration;

use kvloop_router_api::{THRESHOLDS_PATH, ThresholdUpdate};

use crate::agent::Agent;
use crate::metrics::labels;

/// Pushes thresholds to every router every push period (and at once after
/// a path invalidation). Each router is pushed by its own task, with
/// retries and back-off; a push still in flight is not duplicated.
pub async fn run(agent: Arc<Agent>) {
    if agent.config().routers.is_empty() {
        return;
    }
    let in_flight: Vec<Arc<std::sync::atomic::AtomicBool>> = agent
        .config()
        .routers
        .iter()
        .map(|_| Arc::new(std::sync::atomic::AtomicBool::new(false)))
        .collect();
    let period = Duration::from_millis(agent.config().push_period_ms);
    loop {
        let update = agent.threshold_update();
        for (i, r) in agent.config().routers.iter().enumerate() {
            if in_flight[i].swap(true, std::sync::atomic::Ordering::AcqRel) {
                continue;
            }
            let flag = in_flight[i].clone();
            let agent2 = agent.clone();
            let r = r.clone();
            let update = update.clone();
            tokio::spawn(async move {
                push_one(&agent2, &r, &update).await;
                flag.store(false, std::sync::atomic::Ordering::Release);
            });
        }
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = agent.push_wanted() => {}
        }
    }
}

async fn push_one(agent: &Agent, r: &crate::config::RouterTarget, u: &ThresholdUpdate) {
    let url = format!("{}{}", r.url.trim_end_matches('/'), THRESHOLDS_PATH);
    let mut delay = Duration::from_millis(agent.config().push_retry_initial_ms);
    for attempt in 1..=agent.config().push_attempts {
        let res = agent
            .http_client()
            .put(&url)
            .bearer_auth(r.token.as_deref().unwrap_or_default())
            .timeout(Duration::from_millis(agent.config().push_timeout_ms))
            .json(u)
            .send()
            .await;
        let ok = match res {
            Ok(resp) if resp.status().is_success() => true,
            Ok(resp) => {
                let st = resp.status();
                let body = resp.text().await.unwrap_or_default();
                tracing::warn!(router = %r.url, status = %st, %body, attempt, "threshold push refused");
                // 4xx other than 429: retrying the same body will not help.
                if st.is_client_error() && st.as_u16() != 429 {
                    agent
                        .metrics()
                        .pushes
                        .get_or_create(&labels(&[("router", &r.url), ("result", "refused")]))
                        .inc();
                    return;
                }
                false
            }
            Err(e) => {
                tracing::debug!(router = %r.url, error = %e, attempt, "threshold push failed");
                false
            }
        };
        agent
            .metrics()
            .pushes
            .get_or_create(&labels(&[
                ("router", &r.url),
                ("result", if ok { "ok" } else { "error" }),
            ]))
            .inc();
        if ok {
            return;
        }
        if attempt < agent.config().push_attempts {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(agent.config().push_period_ms));
        }
    }
}
