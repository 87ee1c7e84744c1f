//! The cluster demo's processes: Redis and the router replicas on the
//! router node, one agent per engine node, the engines (P on `p*` nodes,
//! D on `d*` nodes, managed mode). Each is a [`ReadyChild`] stopped when
//! dropped; configs and logs go under `--out-dir`.
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use kvloop_cli::child::ReadyChild;
use kvloop_tests::RedisServer;
use kvloop_tests::netns_star::NodeStar;

use super::ClusterArgs;

use super::super::cluster::ADMIN_TOKEN;
/// The name every agent resolves to both router replicas (headless-Service style).
pub(super) const ROUTERS_NAME: &str = "kvloop-routers";
/// Agents' HTTP port (on each node's own address).
pub(super) const AGENT_PORT: u16 = 9470;

/// A policy: how its two replicas are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PolicySpec {
    /// Name in the report.
    pub(super) name: &'static str,
    /// Router `policy`.
    pub(super) policy: &'static str,
    /// Port of both replicas (on the two router addresses).
    pub(super) port: u16,
    /// Agents push thresholds and models to it.
    pub(super) pushed: bool,
}

/// Round robin + vLLM's fixed 64 tokens (the replicas get no pushes).
pub(super) const RR_FIXED: PolicySpec = PolicySpec {
    name: "rr + fixed 64",
    policy: "round_robin",
    port: 18100,
    pushed: false,
};
/// Round robin + the agents' adaptive thresholds.
pub(super) const RR_ADAPTIVE: PolicySpec = PolicySpec {
    name: "rr + adaptive",
    policy: "round_robin",
    port: 18200,
    pushed: true,
};
/// kvloop's selection by predicted TTFT.
pub(super) const KVLOOP: PolicySpec = PolicySpec {
    name: "kvloop",
    policy: "predicted_ttft",
    port: 18300,
    pushed: true,
};

/// The binaries.
pub(super) struct Bins {
    pub(super) sim: PathBuf,
    pub(super) router: PathBuf,
    pub(super) agent: PathBuf,
}

/// An engine.
pub(super) struct Engine {
    pub(super) id: String,
    pub(super) url: String,
    side: String,
    _child: ReadyChild,
}

/// Redis, agents and engines (stopped on drop: engines, agents, Redis).
pub(super) struct Cluster {
    pub(super) prefill: Vec<Engine>,
    pub(super) decode: Vec<Engine>,
    agents: Vec<ReadyChild>,
    /// Redis (the replicas' shared store).
    pub(super) redis: RedisServer,
    /// The two router addresses.
    pub(super) router_addrs: [Ipv4Addr; 2],
    sockets: Vec<PathBuf>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.prefill.clear();
        self.decode.clear();
        self.agents.clear();
        for s in &self.sockets {
            let _ = std::fs::remove_file(s);
        }
    }
}

fn socket(node: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvloop-cluster-{}-{node}.sock", std::process::id()))
}

/// Starts Redis, the agents and the engines on `star` (nodes `router`,
/// `p0..`, `d0..`).
pub(super) fn start(a: &ClusterArgs, star: &NodeStar, bins: &Bins, logs: &Path) -> Result<Cluster> {
    let router_addrs = [star.node("router").addr, star.add_addr("router")?];
    for n in star.nodes.iter().filter(|n| n.name != "router") {
        star.set_hosts(
            &n.name,
            &[
                (ROUTERS_NAME, router_addrs[0]),
                (ROUTERS_NAME, router_addrs[1]),
            ],
        )?;
    }
    let redis = start_redis(star, logs)?;
    let ps: Vec<String> = (0..a.prefill_engines).map(|i| format!("p{i}")).collect();
    let ds: Vec<String> = (0..a.decode_engines).map(|i| format!("d{i}")).collect();
    let mut agents = Vec::new();
    let mut sockets = Vec::new();
    for node in ps.iter().chain(ds.iter()) {
        let is_p = node.starts_with('p');
        let peers = if is_p { &ds } else { &ps };
        let toml = agent_toml(a, star, node, peers, is_p);
        let path = a.out_dir.join(format!("agent-{node}.toml"));
        std::fs::write(&path, toml)?;
        let mut c = star.command_in(node, &bins.agent);
        c.arg("--config")
            .arg(&path)
            .env("RUST_LOG", crate::demo::child_log_filter());
        agents.push(ReadyChild::start(
            &format!("agent-{node}"),
            c,
            Some(&logs.join(format!("agent-{node}.log"))),
            Duration::from_secs(60),
        )?);
        sockets.push(socket(node));
    }
    let engine = |id: &str, role: &str| -> Result<Engine> {
        let ip = star.node(id).addr;
        let mut c = star.command_in(id, &bins.sim);
        c.args(["--role", role, "--engine-id", id])
            .args(["--http-addr", &format!("{ip}:0")])
            .args(["--side-channel-addr", &format!("{ip}:0")])
            .args(["--profile", &a.profile])
            .args(["--time-scale", &a.time_scale.to_string()])
            .args(["--kv-mode", "agent", "--tokenizer", "pieces"])
            .arg("--agent-socket")
            .arg(socket(id))
            .args(["--kv-bytes-per-token", &a.kv_bytes_per_token.to_string()])
            .args(["--kv-capacity-tokens", &a.kv_capacity_tokens.to_string()])
            .args(["--decode-us-per-token", &a.decode_us_per_token.to_string()])
            .args(["--prefill-concurrency", "1"])
            .env("RUST_LOG", crate::demo::child_log_filter());
        let child = ReadyChild::start(
            id,
            c,
            Some(&logs.join(format!("{id}.log"))),
            Duration::from_secs(30),
        )?;
        Ok(Engine {
            id: id.to_string(),
            url: format!("http://{}", child.get("http")?),
            side: child.get("side_channel")?,
            _child: child,
        })
    };
    let prefill = ps
        .iter()
        .map(|p| engine(p, "prefill"))
        .collect::<Result<_>>()?;
    let decode = ds
        .iter()
        .map(|d| engine(d, "decode"))
        .collect::<Result<_>>()?;
    Ok(Cluster {
        prefill,
        decode,
        agents,
        redis,
        router_addrs,
        sockets,
    })
}

/// `redis-server` on the router node's loopback (`kvloop_tests::RedisServer`
/// through `ip netns exec`); the caller's thread is in that namespace, where
/// its readiness is checked.
fn start_redis(star: &NodeStar, logs: &Path) -> Result<RedisServer> {
    let ns = star.node("router").ns.clone();
    RedisServer::start_with(Some(&logs.join("redis.log")), move |bin| {
        kvloop_tests::NodePair::command_in(&ns, bin)
    })
}

/// An agent: probes its peers with READs of the engines' block shape;
/// a P node's agent owns its (P, D) pairs and pushes them to every
/// replica behind [`ROUTERS_NAME`] of the pushed policies.
fn agent_toml(
    a: &ClusterArgs,
    star: &NodeStar,
    node: &str,
    peers: &[String],
    is_p: bool,
) -> String {
    let layers = 4u64;
    let block_len = a.kv_bytes_per_token / layers * 16;
    let ip = star.node(node).addr;
    let (period, rate) = if is_p {
        (400, 8 << 20)
    } else {
        (5000, 1 << 20)
    };
    let mut t = format!(
        r#"agent_id = "agent-{node}"
node_addr = "{ip}"
http_listen = "{ip}:{AGENT_PORT}"
socket_path = "{sock}"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
push_period_ms = 500

[probe]
period_ms = {period}
num_regions = {layers}
num_blocks = 128
block_len_bytes = {block_len}
block_size_tokens = 16
small_blocks = 1
large_blocks = 64
max_bytes_per_s = {rate}
"#,
        sock = socket(node).display()
    );
    for p in peers {
        t.push_str(&format!(
            "\n[[peers]]\nname = \"node-{p}\"\nhttp = \"{}:{AGENT_PORT}\"\n",
            star.node(p).addr
        ));
    }
    if is_p {
        for spec in [RR_ADAPTIVE, KVLOOP] {
            t.push_str(&format!(
                "\n[[routers]]\nurl = \"http://{ROUTERS_NAME}:{}\"\ntoken = \"{ADMIN_TOKEN}\"\n",
                spec.port
            ));
        }
        for d in peers {
            t.push_str(&format!(
                "\n[[pairs]]\nprefill_engine_id = \"{node}\"\ndecode_engine_id = \"{d}\"\ndecode_peer = \"node-{d}\"\nbytes_per_token = {}\nblock_size_tokens = 16\nregions_per_block = {layers}\n",
                a.kv_bytes_per_token
            ));
        }
    }
    t
}

impl Cluster {
    /// The routers' TOML for `spec`, sharing conversations on Redis under
    /// `key_prefix`.
    pub(super) fn router_toml(&self, spec: &PolicySpec, key_prefix: &str) -> String {
        let mut t = format!(
            r#"admin_token = "{ADMIN_TOKEN}"
prefix_check = "tokens"
health_interval_ms = 500
load_interval_ms = 100
policy = "{}"
kv_recompute_threshold = 64
route_header = true
store = "{}"
store_key_prefix = "{key_prefix}"
"#,
            spec.policy,
            self.redis.url()
        );
        if spec.pushed {
            // Not ready until an agent's first push (the restarted replica
            // takes turns only once it has the thresholds and models).
            t.push_str("warmup_ms = 3000\n");
        }
        for (role, list) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            for e in list {
                let (host, port) = e.side.rsplit_once(':').unwrap_or((&e.side, "0"));
                t.push_str(&format!(
                    "\n[[engines]]\nengine_id = \"{}\"\nrole = \"{role}\"\nhttp_url = \"{}\"\nside_channel_host = \"{host}\"\nside_channel_port = {port}\ntp_size = 1\nblock_size_tokens = 16\n",
                    e.id, e.url
                ));
            }
        }
        t
    }

    /// Starts replica `i` (0 or 1) of `spec` with config file `config`,
    /// its stderr to `log`.
    pub(super) fn start_router(
        &self,
        star: &NodeStar,
        bins: &Bins,
        config: &Path,
        spec: &PolicySpec,
        i: usize,
        log: &Path,
    ) -> Result<ReadyChild> {
        let mut c = star.command_in("router", &bins.router);
        c.arg("--config")
            .arg(config)
            .args([
                "--listen",
                &format!("{}:{}", self.router_addrs[i], spec.port),
            ])
            .env("RUST_LOG", crate::demo::child_log_filter());
        ReadyChild::start(
            &format!("router-{i}"),
            c,
            Some(log),
            Duration::from_secs(20),
        )
        .with_context(|| format!("starting router replica {i} of {}", spec.name))
    }

    /// Writes `router-{tag}.toml` for `spec` under `out_dir` (store prefix
    /// `kvloop-{tag}`) and starts both replicas of it, their stderr in
    /// `logs/router-{tag}-{i}.log`; returns them with their URLs (not yet
    /// healthy) and the configuration file (to restart one).
    pub(super) fn start_replicas(
        &self,
        star: &NodeStar,
        bins: &Bins,
        out_dir: &Path,
        logs: &Path,
        spec: &PolicySpec,
        tag: &str,
    ) -> Result<(Vec<ReadyChild>, [String; 2], PathBuf)> {
        let config = out_dir.join(format!("router-{tag}.toml"));
        std::fs::write(&config, self.router_toml(spec, &format!("kvloop-{tag}")))?;
        let mut routers = Vec::new();
        for i in 0..2 {
            let log = logs.join(format!("router-{tag}-{i}.log"));
            routers.push(self.start_router(star, bins, &config, spec, i, &log)?);
        }
        let urls = [0, 1].map(|i| format!("http://{}:{}", self.router_addrs[i], spec.port));
        Ok((routers, urls, config))
    }

    /// Every engine (P then D).
    pub(super) fn engines(&self) -> impl Iterator<Item = &Engine> {
        self.prefill.iter().chain(self.decode.iter())
    }
}
