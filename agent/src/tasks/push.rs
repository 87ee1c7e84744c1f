//! Threshold pushes: every router gets the agent's pair thresholds every
//! push period, and at once after a path invalidation. A router URL whose
//! host is a name is resolved every period and pushed at each of its
//! addresses, so every replica behind one name (a Kubernetes headless
//! Service, several A records) gets every update; replicas that come and
//! go are followed at the next period.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvloop_router_api::{THRESHOLDS_PATH, ThresholdUpdate};

use crate::agent::Agent;
use crate::config::RouterTarget;
use crate::metrics::labels;

/// The base URLs to push `r` at: `r.url` itself when its host is an IP
/// address (or cannot be parsed: the push then reports the error), else
/// one `scheme://address` per address the name resolves to now (none when
/// it resolves to nothing: logged at debug level, retried next period).
pub(crate) async fn targets(r: &RouterTarget) -> Vec<String> {
    let Ok(u) = reqwest::Url::parse(&r.url) else {
        return vec![r.url.clone()];
    };
    let (Some(host), Some(port)) = (u.host_str(), u.port_or_known_default()) else {
        return vec![r.url.clone()];
    };
    if host
        .trim_matches(['[', ']'])
        .parse::<std::net::IpAddr>()
        .is_ok()
    {
        return vec![r.url.clone()];
    }
    match tokio::net::lookup_host((host, port)).await {
        Ok(addrs) => {
            let mut v: Vec<SocketAddr> = addrs.collect();
            v.sort();
            v.dedup();
            v.into_iter()
                .map(|a| {
                    let mut t = u.clone();
                    let _ = t.set_ip_host(a.ip());
                    t.as_str().trim_end_matches('/').to_string()
                })
                .collect()
        }
        Err(e) => {
            tracing::debug!(router = %r.url, error = %e, "router name does not resolve; retrying next period");
            Vec::new()
        }
    }
}

/// Every configured router's addresses ([`targets`]), resolved at most
/// once per `period` (a name's addresses are followed at that pace), for
/// the tasks that send to every router: the threshold pushes and the pull
/// notices (one per READ: a lookup each would be a DNS query per READ).
pub(crate) struct TargetCache {
    period: Duration,
    /// Per `[[routers]]` entry: when resolved, and its addresses.
    entries: Vec<Option<(Instant, Arc<[String]>)>>,
}

impl TargetCache {
    /// An empty cache for `routers` entries.
    pub(crate) fn new(routers: usize, period: Duration) -> Self {
        Self {
            period,
            entries: vec![None; routers],
        }
    }

    /// The addresses of `routers[i]` = `r`, resolved again once `period`
    /// has passed.
    pub(crate) async fn get(&mut self, i: usize, r: &RouterTarget) -> Arc<[String]> {
        match &self.entries[i] {
            Some((at, urls)) if at.elapsed() < self.period => urls.clone(),
            _ => {
                let urls: Arc<[String]> = targets(r).await.into();
                self.entries[i] = Some((Instant::now(), urls.clone()));
                urls
            }
        }
    }
}

/// Pushes thresholds to every router address every push period (and at
/// once after a path invalidation). Each address is pushed by its own
/// task, with retries and back-off; a push still in flight is not
/// duplicated.
pub async fn run(agent: Arc<Agent>) {
    if agent.config().routers.is_empty() {
        return;
    }
    let mut in_flight: HashMap<String, Arc<AtomicBool>> = HashMap::new();
    let period = Duration::from_millis(agent.config().push_period_ms);
    let mut addresses = TargetCache::new(agent.config().routers.len(), period);
    loop {
        let update = agent.threshold_update();
        let mut seen = Vec::new();
        for (i, r) in agent.config().routers.iter().enumerate() {
            for url in addresses.get(i, r).await.iter().cloned() {
                let flag = in_flight.entry(url.clone()).or_default().clone();
                seen.push(url.clone());
                if flag.swap(true, Ordering::AcqRel) {
                    continue;
                }
                let agent2 = agent.clone();
                let target = RouterTarget {
                    url,
                    token: r.token.clone(),
                };
                let update = update.clone();
                tokio::spawn(async move {
                    push_one(&agent2, &target, &update).await;
                    flag.store(false, Ordering::Release);
                });
            }
        }
        // Addresses gone from DNS: forget them (a push in flight finishes).
        in_flight.retain(|u, _| seen.contains(u));
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = agent.push_wanted() => {}
        }
    }
}

/// What became of one call to a router's admin API.
pub(crate) enum Sent {
    /// A 2xx answer.
    Ok,
    /// Another status, with the answer's body.
    Refused(reqwest::StatusCode, String),
    /// No answer (connection, timeout).
    Failed(reqwest::Error),
}

/// Sends `body` as JSON to `url` with `method`, bearer `token` (empty
/// when `None`) and the agent's `push_timeout_ms`.
pub(crate) async fn send_json(
    agent: &Agent,
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    body: &impl serde::Serialize,
) -> Sent {
    let res = agent
        .http_client()
        .request(method, url)
        .bearer_auth(token.unwrap_or_default())
        .timeout(Duration::from_millis(agent.config().push_timeout_ms))
        .json(body)
        .send()
        .await;
    match res {
        Ok(resp) if resp.status().is_success() => Sent::Ok,
        Ok(resp) => {
            let st = resp.status();
            Sent::Refused(st, resp.text().await.unwrap_or_default())
        }
        Err(e) => Sent::Failed(e),
    }
}

async fn push_one(agent: &Agent, r: &RouterTarget, u: &ThresholdUpdate) {
    let url = format!("{}{}", r.url.trim_end_matches('/'), THRESHOLDS_PATH);
    let mut delay = Duration::from_millis(agent.config().push_retry_initial_ms);
    for attempt in 1..=agent.config().push_attempts {
        let ok = match send_json(agent, reqwest::Method::PUT, &url, r.token.as_deref(), u).await {
            Sent::Ok => true,
            Sent::Refused(st, body) => {
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
            Sent::Failed(e) => {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn target(url: &str) -> RouterTarget {
        RouterTarget {
            url: url.into(),
            token: None,
        }
    }

    #[tokio::test]
    async fn an_address_is_pushed_as_is_and_a_name_at_each_of_its_addresses() {
        assert_eq!(
            targets(&target("http://10.0.0.9:8000")).await,
            ["http://10.0.0.9:8000"]
        );
        assert_eq!(targets(&target("not a url")).await, ["not a url"]);
        // `localhost` resolves from /etc/hosts (127.0.0.1, perhaps ::1).
        let t = targets(&target("http://localhost:18000")).await;
        assert!(t.contains(&"http://127.0.0.1:18000".to_string()), "{t:?}");
        assert!(t.iter().all(|u| !u.contains("localhost")), "{t:?}");
        assert!(
            targets(&target("http://no-such-router.invalid:1"))
                .await
                .is_empty()
        );
    }
}
