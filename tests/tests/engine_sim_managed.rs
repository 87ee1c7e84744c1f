//! `kvloop-engine-sim --kv-mode agent` (managed mode) against two real
//! `kvloop-agent` processes on loopback: a prefill engine `p0` registered
//! with agent A and a decode engine `d0` with agent B, both in this test
//! process, their memfd KV memory mapped by the agents. The agents do the
//! engines' READs (P→D and D→P) over libfabric `tcp;ofi_rxm`, check the
//! owner's lease through the owner's agent, and release it on the owner
//! notification; every block that arrives is verified byte-exact by the
//! reading engine. Params that name blocks the lease does not retain, or
//! that were used already, are declined and the engine recomputes.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvloop_engine_sim::{KvMode, Role, SimConfig, SimHandle, TokenizerKind, spawn};
use kvloop_tests::{ReadyChild, bin};

fn free_port() -> u16 {
    kvloop_tests::free_port("127.0.0.1")
}
use serde_json::{Value, json};

/// A running `kvloop-agent`.
struct Agent {
    _child: ReadyChild,
    http: String,
    socket: PathBuf,
}

/// Starts two agents that know each other; returns (A, B).
fn agents(dir: &Path) -> (Agent, Agent) {
    let (ha, hb) = (free_port(), free_port());
    let start = |name: &str, http: u16, peer: &str, peer_http: u16| -> Agent {
        let socket = dir.join(format!("{name}.sock"));
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            kvloop_tests::loopback_agent_toml(name, http, &socket, peer, peer_http),
        )
        .unwrap();
        let mut cmd = Command::new(bin("kvloop-agent"));
        cmd.arg("--config").arg(&cfg).env("RUST_LOG", "warn");
        let child = ReadyChild::start(name, cmd, None, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e:#}"));
        Agent {
            _child: child,
            http: format!("127.0.0.1:{http}"),
            socket,
        }
    };
    (
        start("node-a", ha, "node-b", hb),
        start("node-b", hb, "node-a", ha),
    )
}

fn cfg(role: Role, id: &str, agent: &Agent) -> SimConfig {
    SimConfig {
        role,
        engine_id: id.into(),
        prefill_us_per_token: 1,
        kv_mode: KvMode::Agent,
        agent_socket: Some(agent.socket.clone()),
        kv_capacity_tokens: 8192,
        tokenizer: TokenizerKind::Pieces,
        ..SimConfig::default()
    }
}

async fn post(url: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

async fn text(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

async fn wait_no_holds(e: &SimHandle) {
    for _ in 0..100 {
        if e.engine.stats().holds == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("holds not released: {:?}", e.engine.stats());
}

fn prompt() -> String {
    (0..300)
        .map(|i| format!("word{i}::x"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_move_kv_both_ways_and_release_leases_on_notification() {
    let dir = std::env::temp_dir().join(format!("kvloop-sim-managed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = agents(&dir);
    let p = spawn(cfg(Role::Prefill, "p0", &a)).await.unwrap();
    let d = spawn(cfg(Role::Decode, "d0", &b)).await.unwrap();
    assert_eq!(p.engine.stats().kv_mode, Some(KvMode::Agent));

    // The side channel in the params is the one agent A serves p0's blocks on.
    let status: Value =
        serde_json::from_str(&text(&format!("http://{}/v1/engines", a.http)).await).unwrap();
    let served = status["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["engine_id"] == "p0")
        .unwrap_or_else(|| panic!("p0 not registered with agent A: {status}"))["side_channel"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(served, p.side_channel_addr.to_string());

    let prompt = prompt();
    let (st, pr) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(st, 200, "{pr}");
    assert_eq!(
        pr["kv_transfer_params"]["remote_port"],
        p.side_channel_addr.port()
    );
    let n_prompt = pr["usage"]["prompt_tokens"].as_u64().unwrap();

    // P→D: agent B reads p0's blocks into d0's memory.
    let (st, dr) = post(
        &format!("{}/v1/completions", d.url()),
        json!({"prompt": prompt, "max_tokens": 8, "kv_transfer_params": pr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(st, 200, "{dr}");
    let ds = d.engine.stats();
    assert_eq!(ds.reused_tokens, n_prompt, "{ds:?}");
    assert_eq!(ds.verified_blocks, n_prompt.div_ceil(16));
    assert_eq!(ds.mismatched_blocks, 0);
    // p0's lease ends with d0's owner notification: its blocks are free.
    wait_no_holds(&p).await;

    // D→P on the next turn: agent A reads d0's retained blocks.
    let answer = dr["choices"][0]["text"].as_str().unwrap().to_string();
    let next = format!("{prompt}{answer} and more words here");
    let (st, r1) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": dr["kv_transfer_params"]}),
    )
    .await;
    assert_eq!(st, 200, "{r1}");
    let held = dr["kv_transfer_params"]["remote_num_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(r1["kvloop_sim"]["reused_tokens"], held);
    let ps = p.engine.stats();
    assert_eq!(ps.verified_blocks, held.div_ceil(16), "{ps:?}");
    assert_eq!(ps.mismatched_blocks, 0);
    wait_no_holds(&d).await;

    // The agents counted the READs they did, by direction.
    let ma = text(&format!("http://{}/metrics", a.http)).await;
    let mb = text(&format!("http://{}/metrics", b.http)).await;
    assert!(
        ma.contains(r#"kvloop_agent_reads_total{direction="d2p",result="ok"} 1"#),
        "{ma}"
    );
    assert!(
        mb.contains(r#"kvloop_agent_reads_total{direction="p2d",result="ok"} 1"#),
        "{mb}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn params_outside_the_lease_or_used_twice_are_declined_and_recomputed() {
    let dir = std::env::temp_dir().join(format!("kvloop-sim-managed2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = agents(&dir);
    let p = spawn(cfg(Role::Prefill, "p1", &a)).await.unwrap();
    let d = spawn(cfg(Role::Decode, "d1", &b)).await.unwrap();
    let prompt = prompt();
    let (st, dr) = post(
        &format!("{}/v1/completions", d.url()),
        json!({"prompt": prompt, "max_tokens": 4}),
    )
    .await;
    assert_eq!(st, 200, "{dr}");
    let good = dr["kv_transfer_params"].clone();
    let answer = dr["choices"][0]["text"].as_str().unwrap().to_string();
    let next = format!("{prompt}{answer} then more");

    // Block ids the lease does not retain (shifted past its last block):
    // declined by d1's lease through agent B, never read.
    let mut shifted = good.clone();
    let ids: Vec<u64> = good["remote_block_ids"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() + 1)
        .collect();
    shifted["remote_block_ids"] = json!([ids]);
    let (st, r) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": shifted}),
    )
    .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["kvloop_sim"]["reused_tokens"], 0, "{r}");
    let log: Value = serde_json::from_str(&text(&format!("{}/sim/reads", p.url())).await).unwrap();
    let err = log[0]["error"].as_str().unwrap_or_default().to_string();
    assert!(err.contains("not retained"), "{log}");

    // The real params: read once…
    let (_, r) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": good}),
    )
    .await;
    assert!(
        r["kvloop_sim"]["reused_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    wait_no_holds(&d).await;
    // …and declined the second time (single use: the lease ended).
    let (_, r) = post(
        &format!("{}/v1/completions", p.url()),
        json!({"prompt": next, "max_tokens": 1, "kv_transfer_params": good}),
    )
    .await;
    assert_eq!(r["kvloop_sim"]["reused_tokens"], 0, "{r}");
    let ps = p.engine.stats();
    assert_eq!(ps.reads_declined, 2, "{ps:?}");
    assert_eq!(ps.mismatched_blocks, 0, "{ps:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn agent_mode_without_a_socket_is_refused_naming_the_field() {
    let c = SimConfig {
        kv_mode: KvMode::Agent,
        ..SimConfig::default()
    };
    let e = spawn(c).await.err().expect("refused");
    assert!(e.to_string().contains("agent_socket"), "{e}");
}

/// A full cache evicts D's oldest hold: its lease ends at the agent first,
/// so a READ with the evicted request's params is declined (never served
/// from the blocks D handed to a newer request), while the newest params
/// still read byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_hold_is_released_at_the_agent_before_its_blocks_are_reused() {
    let dir = std::env::temp_dir().join(format!("kvloop-sim-managed3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = agents(&dir);
    let p = spawn(cfg(Role::Prefill, "p3", &a)).await.unwrap();
    // Room for about two conversations' worth of blocks.
    let d = spawn(SimConfig {
        kv_capacity_tokens: 1024,
        ..cfg(Role::Decode, "d3", &b)
    })
    .await
    .unwrap();
    let mut turns = Vec::new();
    for k in 0..3 {
        let prompt = (0..300)
            .map(|i| format!("conv{k}word{i}"))
            .collect::<Vec<_>>()
            .join(" ");
        let (st, dr) = post(
            &format!("{}/v1/completions", d.url()),
            json!({"prompt": prompt, "max_tokens": 4}),
        )
        .await;
        assert_eq!(st, 200, "{dr}");
        assert!(dr["kv_transfer_params"].is_object(), "{dr}");
        turns.push((prompt, dr));
    }
    // The first hold was evicted for the third request.
    let next = |(prompt, dr): &(String, Value)| {
        let answer = dr["choices"][0]["text"].as_str().unwrap().to_string();
        json!({"prompt": format!("{prompt}{answer} more"), "max_tokens": 1,
               "kv_transfer_params": dr["kv_transfer_params"]})
    };
    let (_, r) = post(&format!("{}/v1/completions", p.url()), next(&turns[0])).await;
    assert_eq!(r["kvloop_sim"]["reused_tokens"], 0, "{r}");
    let (_, r) = post(&format!("{}/v1/completions", p.url()), next(&turns[2])).await;
    assert!(
        r["kvloop_sim"]["reused_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    let ps = p.engine.stats();
    assert_eq!(ps.reads_declined, 1, "{ps:?}");
    assert_eq!(ps.mismatched_blocks, 0, "{ps:?}");
    assert!(ps.verified_blocks > 0, "{ps:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
