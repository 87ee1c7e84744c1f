//! The Redis conversation store against a real `redis-server` (Debian package
//! `redis-server`, installed by scripts/bootstrap.sh), which each test starts
//! itself on a free loopback port in a temporary directory without
//! persistence, and stops by PID. Without `redis-server` these tests FAIL.
mod common;

use std::cell::RefCell;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvloop_router::RouterConfig;
use kvloop_router::fingerprint::Fingerprint;
use kvloop_router::metrics::Metrics;
use kvloop_router::params::KvParams;
use kvloop_router::store::{ConvKey, ConversationStore, Lookup, Store, StoredTurn};
use serde_json::{Value, json};

/// A `redis-server` of this test: loopback, free port, temp dir, no
/// persistence (`kvloop_tests::RedisServer`); a missing one FAILS the test.
struct Redis(kvloop_tests::RedisServer);

impl Redis {
    fn start() -> Redis {
        Redis(kvloop_tests::RedisServer::start().expect("redis-server starts"))
    }
    fn url(&self) -> String {
        self.0.url()
    }
    fn restart(&mut self) {
        self.0.restart().expect("redis-server restarts");
    }
    fn kill(&mut self) {
        self.0.kill();
    }
}

fn store_cfg(url: &str, ttl_ms: u64) -> RouterConfig {
    RouterConfig {
        store: url.into(),
        decoder_kv_blocks_ttl_ms: ttl_ms + 1_000,
        ttl_safety_margin_ms: 1_000,
        store_reconnect_min_ms: 20,
        store_reconnect_max_ms: 200,
        ..RouterConfig::default()
    }
}

/// A replica's store (its own pool and metrics) on `url`, connected.
async fn replica(url: &str, ttl_ms: u64) -> Arc<Store> {
    let s = Arc::new(
        Store::from_config(
            &store_cfg(url, ttl_ms),
            vec!["p0".into(), "d0".into()],
            &Metrics::new(),
        )
        .unwrap(),
    );
    wait_until(|| s.health().up, "store connects").await;
    s
}

async fn wait_until(mut f: impl FnMut() -> bool, what: &str) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(15), "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn turn(i: u32) -> StoredTurn {
    let p = KvParams::parse(
        &json!({"remote_engine_id": "d0", "remote_request_id": format!("r{i}"),
        "remote_block_ids": [[1, 2, 3, i]], "remote_port": 1}),
    )
    .unwrap();
    StoredTurn {
        params: p.compact(),
        decode_engine: 1,
        remote_num_tokens: 100 + i,
        fingerprint: Fingerprint {
            tokens_len: i,
            tokens_hash: u64::MAX - u64::from(i),
            history_len: 2,
            history_hash: 7,
        },
        expires_at_ms: 0,
        stored_at_unix_ms: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs redis-server"]
async fn two_replicas_race_and_exactly_one_takes() {
    let redis = Redis::start();
    let (a, b) = (
        replica(&redis.url(), 60_000).await,
        replica(&redis.url(), 60_000).await,
    );
    for round in 0..200u32 {
        let key = ConvKey::new("t", &format!("race-{round}"));
        a.insert(key.clone(), turn(round), 0).await.unwrap();
        let barrier = Arc::new(tokio::sync::Barrier::new(6));
        let tasks: Vec<_> = (0..6)
            .map(|k| {
                let s = if k % 2 == 0 { a.clone() } else { b.clone() };
                let (key, barrier) = (key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    s.take(&key, 1).await.unwrap()
                })
            })
            .collect();
        let mut found = Vec::new();
        for t in tasks {
            if let Lookup::Found(t) = t.await.unwrap() {
                found.push(t);
            }
        }
        assert_eq!(
            found.len(),
            1,
            "round {round}: exactly one replica takes it"
        );
        let mut want = turn(round);
        want.expires_at_ms = 1;
        assert_eq!(found[0], want, "bit-exact params and fingerprint");
    }
}

#[tokio::test]
#[ignore = "needs redis-server"]
async fn entries_expire_by_redis_ttl() {
    let redis = Redis::start();
    let s = replica(&redis.url(), 300).await;
    let k = ConvKey::new("t", "ttl");
    s.insert(k.clone(), turn(1), 0).await.unwrap();
    assert!(matches!(s.take(&k, 0).await.unwrap(), Lookup::Found(_)));
    s.insert(k.clone(), turn(2), 0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.take(&k, 0).await.unwrap(), Lookup::Missing, "expired");
    // An overwrite reports the turn it replaced (issue 15's release hook).
    s.insert(k.clone(), turn(3), 0).await.unwrap();
    let ev = s.insert(k.clone(), turn(4), 0).await.unwrap();
    assert_eq!(ev.dropped.len(), 1);
    assert_eq!(ev.dropped[0].turn.remote_num_tokens, 103);
}

#[tokio::test]
#[ignore = "needs redis-server"]
async fn tenants_are_isolated_in_redis() {
    let redis = Redis::start();
    let s = replica(&redis.url(), 60_000).await;
    s.insert(ConvKey::new("a", "c"), turn(1), 0).await.unwrap();
    s.insert(ConvKey::new("a:c", "x"), turn(2), 0)
        .await
        .unwrap();
    assert_eq!(
        s.take(&ConvKey::new("b", "c"), 0).await.unwrap(),
        Lookup::Missing
    );
    assert_eq!(
        s.take(&ConvKey::new("a", "c:x"), 0).await.unwrap(),
        Lookup::Missing
    );
    assert!(
        matches!(s.take(&ConvKey::new("a", "c"), 0).await.unwrap(), Lookup::Found(t) if t.remote_num_tokens == 101)
    );
    assert!(
        matches!(s.take(&ConvKey::new("a:c", "x"), 0).await.unwrap(), Lookup::Found(t) if t.remote_num_tokens == 102)
    );
}

thread_local! {
    static STORE_URL: RefCell<String> = const { RefCell::new(String::new()) };
}

async fn store_status(c: &Cluster) -> String {
    c.get_json("/health").await["store"]["status"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

async fn wait_status(c: &Cluster, want: &str) {
    let t0 = Instant::now();
    while store_status(c).await != want {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "store status never {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One turn extending `m`; returns the next turn's messages.
async fn turn_of(c: &Cluster, conv: &str, m: &[Value], n: usize) -> Vec<Value> {
    let (st, a) = c.chat(None, conv, m, n.is_multiple_of(2), json!({})).await;
    assert_eq!(st, 200, "turn {n}: {a}");
    let mut next = m.to_vec();
    next.push(assistant(&a));
    next.push(user(&words(20, &format!("u{n}x"))));
    next
}

#[tokio::test]
#[ignore = "needs redis-server"]
async fn router_keeps_serving_through_a_redis_outage_and_recovers() {
    let mut redis = Redis::start();
    STORE_URL.with(|u| *u.borrow_mut() = redis.url());
    let c = Cluster::start(Opts {
        tweak: |cfg| {
            cfg.store = STORE_URL.with(|u| u.borrow().clone());
            cfg.store_timeout_ms = 200;
            cfg.store_reconnect_min_ms = 20;
            cfg.store_reconnect_max_ms = 200;
        },
        ..Opts::default()
    })
    .await;
    wait_status(&c, "ok").await;
    let h = c.get_json("/health").await;
    assert_eq!(h["store"]["backend"], "redis");
    let m = turn_of(&c, "conv-o", &[user(&words(100, "a"))], 1).await;
    let m = turn_of(&c, "conv-o", &m, 2).await;
    assert_eq!(c.metric(PULLED).await, 1.0, "turn 2 pulled through Redis");
    assert_eq!(c.metric("kvloop_router_store_up").await, 1.0);

    redis.kill();
    // Keeps serving: turns recompute, nothing fails.
    let m = turn_of(&c, "conv-o", &m, 3).await;
    let m = turn_of(&c, "conv-o", &m, 4).await;
    assert_eq!(c.metric(PULLED).await, 1.0);
    wait_status(&c, "degraded").await;
    let h = c.get_json("/health").await;
    assert_eq!(h["status"], "ok", "engines fine: the router still serves");
    assert!(h["store"]["last_error"].is_string(), "{h}");
    assert_eq!(c.metric("kvloop_router_store_up").await, 0.0);
    assert!(
        c.metric("kvloop_router_store_errors_total{op=\"take\"}")
            .await
            >= 1.0
    );

    redis.restart();
    wait_status(&c, "ok").await;
    assert_eq!(c.metric("kvloop_router_store_up").await, 1.0);
    assert!(c.metric("kvloop_router_store_reconnects_total").await >= 1.0);
    let m = turn_of(&c, "conv-o", &m, 5).await; // Redis came back empty: stores again
    turn_of(&c, "conv-o", &m, 6).await;
    assert_eq!(c.metric(PULLED).await, 2.0, "reuse is back");
}

// ---- two router processes sharing one Redis ----

/// Two `kvloop-router` processes on `redis` with the config lines `extra`
/// and the `[[engines]]` `registry`, their store connected: the
/// processes (stopped on drop) and their base URLs.
async fn two_routers(
    redis: &Redis,
    extra: &str,
    registry: &str,
) -> (
    kvloop_tests::ReadyChild,
    kvloop_tests::ReadyChild,
    [String; 2],
) {
    let cfg = format!(
        "listen = \"127.0.0.1:0\"\nstore = \"{}\"\nstore_reconnect_min_ms = 20\n{extra}\n{registry}",
        redis.url(),
    );
    let path = redis.0.dir().join("router.toml");
    std::fs::write(&path, cfg).unwrap();
    let router = PathBuf::from(env!("CARGO_BIN_EXE_kvloop-router"));
    let ra = start_bin(&router, &["--config", path.to_str().unwrap()]);
    let rb = start_bin(&router, &["--config", path.to_str().unwrap()]);
    let bases = [&ra, &rb].map(|r| format!("http://{}", r.get("http").unwrap()));
    let http = reqwest::Client::new();
    for base in &bases {
        wait_health(
            &http,
            base,
            |h| h["store"]["status"] == "ok",
            "store never ok",
        )
        .await;
    }
    (ra, rb, bases)
}

/// GET `base/health` until `ok(health)`, or panic after 15 s.
async fn wait_health(http: &reqwest::Client, base: &str, ok: impl Fn(&Value) -> bool, what: &str) {
    let t0 = Instant::now();
    loop {
        let h = get_json(http, &format!("{base}/health")).await;
        if ok(&h) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{base}: {what}: {h}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server"]
async fn second_replica_pulls_the_turn_the_first_stored() {
    let redis = Redis::start();
    let p = start_sim_process("prefill", "p0");
    let d = start_sim_process("decode", "d0");
    let (_ra, _rb, [a, b]) = two_routers(&redis, "", &p0_d0_registry(&p, &d)).await;
    let http = reqwest::Client::new();
    let mut messages = vec![user(&words(200, "w"))];
    for (turn, base) in [&a, &b, &a, &b].into_iter().enumerate() {
        let body = json!({"model": "sim-model", "messages": messages, "stream": turn % 2 == 1,
                          "max_tokens": 12, "conversation_id": "conv-2r"});
        let (st, answer) = post(
            &http,
            &format!("{base}/v1/chat/completions"),
            None,
            &body,
            turn % 2 == 1,
        )
        .await;
        assert_eq!(st, 200, "turn {turn}: {answer}");
        messages.push(assistant(&answer));
        messages.push(user(&words(30, &format!("t{turn}x"))));
    }
    assert_eq!(
        metric(&http, &a, NO_ENTRY).await,
        1.0,
        "turn 1 on A: nothing stored yet"
    );
    assert_eq!(
        metric(&http, &b, PULLED).await,
        2.0,
        "turns 2 and 4 on B pull what A stored"
    );
    assert_eq!(
        metric(&http, &a, PULLED).await,
        1.0,
        "turn 3 on A pulls what B stored"
    );
    let stats = get_json(
        &http,
        &format!("http://{}/sim/stats", p.get("http").unwrap()),
    )
    .await;
    assert_eq!(stats["reads_ok"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server"]
async fn replicas_break_ties_on_different_prefill_engines() {
    // Two replicas that choose at the same instant, before either has
    // shared what it sent, must not both send their first turn to p0.
    let redis = Redis::start();
    let (p0, p1) = (
        start_sim_process("prefill", "p0"),
        start_sim_process("prefill", "p1"),
    );
    let d = start_sim_process("decode", "d0");
    let registry = [
        (&p0, "p0", "prefill"),
        (&p1, "p1", "prefill"),
        (&d, "d0", "decode"),
    ]
    .map(|(c, id, role)| registry_entry(c, id, role))
    .join("\n");
    let (_ra, _rb, bases) = two_routers(&redis, "policy = \"predicted_ttft\"", &registry).await;
    let http = reqwest::Client::new();
    let mut ranks = Vec::new();
    for base in &bases {
        wait_health(
            &http,
            base,
            |h| h["replicas"]["sharing"] == 2,
            "never saw 2 replicas",
        )
        .await;
        let h = get_json(&http, &format!("{base}/health")).await;
        ranks.push(h["replicas"]["rank"].as_u64().unwrap());
    }
    ranks.sort_unstable();
    assert_eq!(ranks, vec![0, 1], "each replica has its own rank");
    // No cost model pushed: each replica's first turn falls back to its
    // round robin, which starts at its rank.
    for (i, base) in bases.iter().enumerate() {
        let body = json!({"model": "sim-model", "messages": [user(&words(50, &format!("r{i}")))],
                          "max_tokens": 4, "conversation_id": format!("conv-{i}")});
        let (st, answer) = post(
            &http,
            &format!("{base}/v1/chat/completions"),
            None,
            &body,
            false,
        )
        .await;
        assert_eq!(st, 200, "{answer}");
    }
    let mut requests = Vec::new();
    for c in [&p0, &p1] {
        let stats = get_json(
            &http,
            &format!("http://{}/sim/stats", c.get("http").unwrap()),
        )
        .await;
        requests.push(stats["requests"].as_u64().unwrap());
    }
    assert_eq!(
        (requests[0], requests[1]),
        (1, 1),
        "the replicas' first turns went to different prefill engines"
    );
}

#[tokio::test]
#[ignore = "needs redis-server"]
async fn replicas_share_their_prefill_lines_and_forget_silent_ones() {
    use kvloop_router::select::share::{self, LoadShare, SHARE_VERSION, ShareLine};
    let redis = Redis::start();
    let (a, b) = (
        replica(&redis.url(), 60_000).await,
        replica(&redis.url(), 60_000).await,
    );
    let line = |age: u64, us: u64| LoadShare {
        v: SHARE_VERSION,
        sent_unix_ms: 1,
        engines: [(
            "p0".to_string(),
            ShareLine {
                items: vec![(age, us)],
                done_age_ms: None,
                conversations: Vec::new(),
                reading: 0,
            },
        )]
        .into(),
    };
    let got = a
        .exchange_load("replica-a", share::encode(&line(5, 1000)), 10_000, &[])
        .await
        .unwrap()
        .expect("redis shares");
    assert_eq!(got.len(), 1);
    let got = b
        .exchange_load("replica-b", share::encode(&line(7, 2000)), 10_000, &[])
        .await
        .unwrap()
        .unwrap();
    let mut fields: Vec<&str> = got.iter().map(|(f, _)| f.as_str()).collect();
    fields.sort();
    assert_eq!(fields, ["replica-a", "replica-b"]);
    let a_share = got.iter().find(|(f, _)| f == "replica-a").unwrap();
    assert_eq!(share::decode(&a_share.1).unwrap(), line(5, 1000));
    // A forgets B (silent too long): B's field is gone.
    let got = a
        .exchange_load(
            "replica-a",
            share::encode(&line(6, 1000)),
            10_000,
            &["replica-b".into()],
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 1, "only A's own field is left");
    // The memory store shares nothing.
    let m =
        Store::from_config(&RouterConfig::default(), vec!["p0".into()], &Metrics::new()).unwrap();
    assert!(
        m.exchange_load("x", vec![], 1, &[])
            .await
            .unwrap()
            .is_none()
    );
}
