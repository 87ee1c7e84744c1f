//! Test harness: engine-sims and a router in-process on loopback ports.
#![allow(dead_code)]

pub mod mock;

use std::sync::Arc;

use kvloop_engine_sim::{Role as SimRole, SimConfig, SimHandle, StatsSnapshot};
use kvloop_router::registry::{EngineConfig, Role};
use kvloop_router::{ManualClock, RouterConfig, RunningRouter};
use serde_json::{Value, json};

pub const TOKEN: &str = "test-admin-token";

pub struct Cluster {
    pub prefill: Vec<SimHandle>,
    pub decode: Vec<SimHandle>,
    pub router: RunningRouter,
    pub clock: Arc<ManualClock>,
    pub http: reqwest::Client,
}

pub struct Opts {
    pub n_prefill: usize,
    pub n_decode: usize,
    pub ipv6: bool,
    pub no_tokenize: bool,
    /// Register P under another id than the one it writes in its params.
    pub misregister_prefill: bool,
    pub tweak: fn(&mut RouterConfig),
    pub sim_tweak: fn(&mut SimConfig),
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            n_prefill: 1,
            n_decode: 1,
            ipv6: false,
            no_tokenize: false,
            misregister_prefill: false,
            tweak: |_| {},
            sim_tweak: |_| {},
        }
    }
}

pub async fn sim(role: SimRole, id: &str, o: &Opts) -> SimHandle {
    let lo = if o.ipv6 { "[::1]:0" } else { "127.0.0.1:0" };
    let mut c = SimConfig {
        role,
        engine_id: id.into(),
        http_addr: lo.parse().unwrap(),
        side_channel_addr: lo.parse().unwrap(),
        prefill_us_per_token: 1,
        transfer_us_per_token: 0,
        no_tokenize: o.no_tokenize,
        ..SimConfig::default()
    };
    if o.ipv6 {
        // the router must rewrite this from its registry, or READs fail
        c.advertised_host = Some("unroutable.invalid".into());
    }
    (o.sim_tweak)(&mut c);
    kvloop_engine_sim::spawn(c)
        .await
        .expect("engine-sim starts")
}

fn entry(h: &SimHandle, id: &str, role: Role) -> EngineConfig {
    let ip = h.side_channel_addr.ip().to_string();
    EngineConfig::new(id, role, &h.url(), &ip, h.side_channel_addr.port())
}

impl Cluster {
    pub async fn start(o: Opts) -> Cluster {
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        let mut engines = Vec::new();
        for i in 0..o.n_prefill {
            let id = format!("p{i}");
            let h = sim(SimRole::Prefill, &id, &o).await;
            let reg_id = if o.misregister_prefill {
                format!("other-{id}")
            } else {
                id
            };
            engines.push(entry(&h, &reg_id, Role::Prefill));
            prefill.push(h);
        }
        for i in 0..o.n_decode {
            let id = format!("d{i}");
            let h = sim(SimRole::Decode, &id, &o).await;
            engines.push(entry(&h, &id, Role::Decode));
            decode.push(h);
        }
        let mut cfg = RouterConfig {
            listen: if o.ipv6 {
                "[::1]:0".parse().unwrap()
            } else {
                "127.0.0.1:0".parse().unwrap()
            },
            admin_token: TOKEN.into(),
            engines,
            ..RouterConfig::default()
        };
        (o.tweak)(&mut cfg);
        let clock = Arc::new(ManualClock::default());
        let router = kvloop_router::start(cfg, Box::new(clock.clone()))
            .await
            .expect("router starts");
        Cluster {
            prefill,
            decode,
            router,
            clock,
            http: reqwest::Client::new(),
        }
    }

    /// `GET <router><path>` as JSON.
    pub async fn get_json(&self, path: &str) -> Value {
        self.get_json_as(path, None).await
    }

    /// `GET <router><path>` as JSON, with the admin token.
    pub async fn get_json_auth(&self, path: &str) -> Value {
        self.get_json_as(path, Some(TOKEN)).await
    }

    async fn get_json_as(&self, path: &str, token: Option<&str>) -> Value {
        self.get_status_json_as(path, token).await.1
    }

    /// `GET <router><path>`: the status and the body as JSON.
    pub async fn get_status_json(&self, path: &str) -> (u16, Value) {
        self.get_status_json_as(path, None).await
    }

    async fn get_status_json_as(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        let mut r = self.http.get(format!("{}{path}", self.router.url()));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let r = r.send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    pub async fn metric(&self, series: &str) -> f64 {
        metric(&self.http, &self.router.url(), series).await
    }

    pub fn p_stats(&self, i: usize) -> StatsSnapshot {
        self.prefill[i].engine.stats()
    }

    pub fn d_stats(&self, i: usize) -> StatsSnapshot {
        self.decode[i].engine.stats()
    }

    /// One chat turn. Returns (status, answer text or error body).
    pub async fn chat(
        &self,
        tenant: Option<&str>,
        conv: &str,
        messages: &[Value],
        stream: bool,
        sim: Value,
    ) -> (u16, String) {
        let body = json!({"model": "sim-model", "messages": messages, "max_tokens": 8, "stream": stream,
                          "conversation_id": conv, "sim": sim});
        post(
            &self.http,
            &format!("{}/v1/chat/completions", self.router.url()),
            tenant,
            &body,
            stream,
        )
        .await
    }
}

pub async fn post(
    http: &reqwest::Client,
    url: &str,
    tenant: Option<&str>,
    body: &Value,
    stream: bool,
) -> (u16, String) {
    let mut req = http.post(url).json(body);
    if let Some(t) = tenant {
        req = req.header("x-tenant-id", t);
    }
    let r = req.send().await.expect("router reachable");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    if status != 200 {
        return (status, text);
    }
    if stream {
        let mut out = String::new();
        for line in text.lines() {
            let Some(d) = line.strip_prefix("data: ") else {
                continue;
            };
            if d == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(d).unwrap();
            if let Some(c) = v["choices"].get(0) {
                if let Some(t) = c["delta"]["content"].as_str() {
                    out.push_str(t);
                }
                if let Some(t) = c["text"].as_str() {
                    out.push_str(t);
                }
            }
        }
        (status, out)
    } else {
        let v: Value = serde_json::from_str(&text).unwrap();
        let c = &v["choices"][0];
        let t = c["message"]["content"]
            .as_str()
            .or(c["text"].as_str())
            .unwrap_or_default();
        (status, t.to_string())
    }
}

/// `GET url` as JSON (panics on a transport error or a body that is not JSON).
pub async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

pub async fn metric(http: &reqwest::Client, base: &str, series: &str) -> f64 {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
                .map(|v| v.trim().parse::<f64>().unwrap())
        })
        .unwrap_or(0.0)
}

pub fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

pub fn assistant(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

pub fn words(n: usize, tag: &str) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

pub const PULLED: &str = "kvloop_router_decisions_total{reason=\"pulled\"}";
pub const NO_ENTRY: &str = "kvloop_router_decisions_total{reason=\"no_entry\"}";
pub const EXPIRED: &str = "kvloop_router_decisions_total{reason=\"expired\"}";
pub const MISMATCH: &str = "kvloop_router_decisions_total{reason=\"prefix_mismatch\"}";
pub const BELOW: &str = "kvloop_router_decisions_total{reason=\"recomputed_below_threshold\"}";

/// `bin args…` as a [`kvloop_tests::ReadyChild`] (its `READY key=value`
/// line read, stopped on drop).
pub fn start_bin(bin: &std::path::Path, args: &[&str]) -> kvloop_tests::ReadyChild {
    let mut cmd = std::process::Command::new(bin);
    cmd.args(args);
    kvloop_tests::ReadyChild::start(
        &bin.display().to_string(),
        cmd,
        None,
        std::time::Duration::from_secs(30),
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
}

/// The `kvloop-engine-sim` binary next to the router's (built when missing).
pub fn engine_sim_bin() -> std::path::PathBuf {
    let router = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvloop-router"));
    let bin = router.with_file_name("kvloop-engine-sim");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "-p", "kvloop-engine-sim"]);
        if router
            .parent()
            .and_then(|p| p.file_name())
            .is_some_and(|n| n == "release")
        {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("cargo runs");
        assert!(st.success(), "building kvloop-engine-sim failed");
    }
    assert!(bin.exists(), "{} missing after build", bin.display());
    bin
}

/// An engine-sim process of `role` (`prefill`, `decode`) with id `id`.
pub fn start_sim_process(role: &str, id: &str) -> kvloop_tests::ReadyChild {
    start_bin(
        &engine_sim_bin(),
        &[
            "--role",
            role,
            "--engine-id",
            id,
            "--prefill-us-per-token",
            "1",
        ],
    )
}

/// One `[[engines]]` entry of a router config for the engine-sim `c`
/// (its `READY` lines `http`, `side_channel`), as `id` in `role`.
pub fn registry_entry(c: &kvloop_tests::ReadyChild, id: &str, role: &str) -> String {
    let side = c.get("side_channel").unwrap();
    let (host, port) = side.rsplit_once(':').unwrap();
    format!(
        "[[engines]]\nengine_id = \"{id}\"\nrole = \"{role}\"\nhttp_url = \"http://{}\"\nside_channel_host = \"{host}\"\nside_channel_port = {port}\n",
        c.get("http").unwrap()
    )
}

/// The `[[engines]]` registry of a router config naming P `p0` and D `d0`
/// from their `READY` lines (`http`, `side_channel`).
pub fn p0_d0_registry(p: &kvloop_tests::ReadyChild, d: &kvloop_tests::ReadyChild) -> String {
    format!(
        "{}\n{}",
        registry_entry(p, "p0", "prefill"),
        registry_entry(d, "d0", "decode")
    )
}
