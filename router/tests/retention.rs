//! Decode-side retention at the router (issue 15), against in-process
//! engine-sims and a recording stand-in for the agent's retention API
//! (`POST /v1/leases/retention`; the real agent's side is tested in
//! agent/src/lease.rs and end to end in tests/tests/demo_tools.rs):
//! without a known agent decisions are only counted; with one, every stored
//! turn gets a first lease and a turn nobody will pull is released, with
//! the router's admin token; `DELETE /v1/conversations/{id}` is
//! tenant-scoped and authenticated.
mod common;

use std::sync::Arc;

use axum::Json;
use axum::http::HeaderMap;
use common::*;
use kvloop_router_api::{PairThreshold, ThresholdUpdate};
use parking_lot::Mutex;
use serde_json::{Value, json};

const ENDED_UNMANAGED: &str =
    r#"kvloop_router_retention_total{action="release",cause="ended",result="unmanaged"}"#;

async fn first_turn(c: &Cluster, tenant: Option<&str>, conv: &str) -> Vec<Value> {
    let m1 = vec![user(&words(100, "a"))];
    let (st, a1) = c.chat(tenant, conv, &m1, false, json!({})).await;
    assert_eq!(st, 200, "{a1}");
    vec![m1[0].clone(), assistant(&a1), user(&words(20, "b"))]
}

async fn delete(c: &Cluster, conv: &str, tenant: Option<&str>, token: Option<&str>) -> u16 {
    let mut r = c
        .http
        .delete(format!("{}/v1/conversations/{conv}", c.router.url()));
    if let Some(t) = tenant {
        r = r.header("x-tenant-id", t);
    }
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    r.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn without_an_agent_decisions_are_counted_and_delete_is_scoped() {
    let c = Cluster::start(Opts::default()).await;
    first_turn(&c, Some("acme"), "conv-1").await;
    assert_eq!(delete(&c, "conv-1", Some("acme"), None).await, 401);
    assert_eq!(
        delete(&c, "conv-1", Some("other"), Some(TOKEN)).await,
        404,
        "another tenant's conversation"
    );
    assert_eq!(delete(&c, "conv-1", Some("acme"), Some(TOKEN)).await, 204);
    assert_eq!(delete(&c, "conv-1", Some("acme"), Some(TOKEN)).await, 404);
    // Stock vLLM: nobody to tell, the release is counted.
    assert_eq!(c.metric(ENDED_UNMANAGED).await, 1.0);
    let v = c.get_json_auth("/admin/retention?n=5").await;
    assert_eq!(v["config"]["mode"], "adaptive", "{v}");
    assert_eq!(v["decisions"][0]["result"], "unmanaged", "{v}");
    assert_eq!(v["decisions"][0]["conversation"], "acme/conv-1", "{v}");
}

/// What the stand-in agent received: (bearer, body).
type Seen = Arc<Mutex<Vec<(Option<String>, Value)>>>;

/// A stand-in agent; `hosts_d` false: it answers 404 `unknown_engine` as
/// an agent in front of stock vLLM does.
async fn stand_in_agent(hosts_d: bool) -> (String, Seen) {
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    let app = axum::Router::new().route(
        "/v1/leases/retention",
        axum::routing::post(move |h: HeaderMap, Json(b): Json<Value>| {
            let s2 = s2.clone();
            async move {
                let bearer = h
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .map(|v| v.trim_start_matches("Bearer ").to_string());
                let keep = b["keep_ms"].as_u64().unwrap_or(0);
                s2.lock().push((bearer, b));
                let body = if !hosts_d {
                    json!({"kind": "unknown_engine", "message": "engine_id `d0`: no known agent hosts it"})
                } else if keep == 0 {
                    json!({"outcome": "released", "blocks": 3})
                } else {
                    json!({"outcome": "kept", "expires_in_ms": keep + 5000})
                };
                let code = if hosts_d { 200 } else { 404 };
                (axum::http::StatusCode::from_u16(code).unwrap(), Json(body))
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    (url, seen)
}

fn push_with(agent: &str, seq: u64) -> ThresholdUpdate {
    ThresholdUpdate {
        agent_id: "node-a".into(),
        seq,
        pairs: vec![PairThreshold {
            prefill_engine_id: "p0".into(),
            decode_engine_id: "d0".into(),
            threshold_tokens: 64,
            valid_for_ms: 600_000,
            model: None,
        }],
        agent_url: Some(agent.to_string()),
    }
}

async fn push(c: &Cluster, u: &ThresholdUpdate) {
    let r = c
        .http
        .put(format!(
            "{}{}",
            c.router.url(),
            kvloop_router_api::THRESHOLDS_PATH
        ))
        .bearer_auth(TOKEN)
        .json(u)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
}

#[tokio::test]
async fn an_agent_that_hosts_no_decode_engine_makes_it_unmanaged_for_a_while() {
    let c = Cluster::start(Opts::default()).await;
    let (agent, seen) = stand_in_agent(false).await;
    push(&c, &push_with(&agent, 1)).await;
    first_turn(&c, None, "conv-u").await;
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while c.get_json_auth("/admin/retention").await["agents"]
        .as_object()
        .is_some_and(|m| !m.is_empty())
        && std::time::Instant::now() < end
    {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The next push does not make the router ask again (for a minute).
    push(&c, &push_with(&agent, 2)).await;
    first_turn(&c, None, "conv-v").await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(seen.lock().len(), 1, "asked once, then not again");
    // The 404 is counted as unmanaged; without an agent no lease is sized
    // (releases are still counted: the first test).
    assert_eq!(
        c.metric(
            r#"kvloop_router_retention_total{action="keep",cause="first_lease",result="unmanaged"}"#
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_pushing_agent_gets_first_leases_and_releases() {
    let c = Cluster::start(Opts::default()).await;
    let (agent, seen) = stand_in_agent(true).await;
    push(&c, &push_with(&agent, 1)).await;
    // Turn 1 is stored: its first lease (no gaps yet: the whole cap).
    let m2 = first_turn(&c, None, "conv-a").await;
    // Turn 2 does not extend turn 1 (another history): turn 1's hold is
    // released (prefix mismatch); turn 2 is stored with its own lease.
    let other = vec![user(&words(30, "z"))];
    let (st, _) = c.chat(None, "conv-a", &other, false, json!({})).await;
    assert_eq!(st, 200);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while seen.lock().len() < 3 && std::time::Instant::now() < end {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let seen = seen.lock().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for (bearer, b) in &seen {
        assert_eq!(bearer.as_deref(), Some(TOKEN), "{b}");
        assert_eq!(b["engine_id"], "d0", "{b}");
        assert_eq!(b["version"], 1, "{b}");
        assert_eq!(b["forwarded"], false, "{b}");
    }
    let keeps: Vec<&Value> = seen
        .iter()
        .map(|(_, b)| b)
        .filter(|b| b["keep_ms"] != 0)
        .collect();
    let releases: Vec<&Value> = seen
        .iter()
        .map(|(_, b)| b)
        .filter(|b| b["keep_ms"] == 0)
        .collect();
    assert_eq!(keeps.len(), 2, "a first lease per stored turn: {seen:?}");
    assert_eq!(keeps[0]["keep_ms"], 480_000);
    assert_eq!(releases.len(), 1, "{seen:?}");
    assert_eq!(
        releases[0]["request_id"], keeps[0]["request_id"],
        "turn 1's hold released"
    );
    // The router counts each once the agent's answer is back.
    let m = |s: &str| format!("kvloop_router_retention_total{{{s}}}");
    let released = m(r#"action="release",cause="prefix_mismatch",result="released""#);
    let kept = m(r#"action="keep",cause="first_lease",result="kept""#);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while (c.metric(&released).await < 1.0 || c.metric(&kept).await < 2.0)
        && std::time::Instant::now() < end
    {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(c.metric(&released).await, 1.0);
    assert_eq!(c.metric(&kept).await, 2.0);
    drop(m2);
}
