//! The processes of the demo: one agent per node, the engines P (node A)
//! and D (node B), and one router per mode (node A), each a [`ReadyChild`]
//! stopped when dropped.
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use kvloop_cli::child::ReadyChild;

use super::DemoArgs;
use super::topology::{Topology, free_port};

/// Router token shared by the demo's routers and agents.
pub(super) const ADMIN_TOKEN: &str = "kvloop-demo";

/// TOML of one demo agent. Agent A (node of P) pushes the (p0, d0)
/// threshold to `router`; both probe each other with READs of the engines'
/// block shape (4 regions of `16 × slot` bytes).
#[allow(clippy::too_many_arguments)]
fn agent_toml(
    name: &str,
    ip: IpAddr,
    http_port: u16,
    socket: &Path,
    peer: &str,
    peer_http: &str,
    router: Option<&str>,
    kv_bytes_per_token: u64,
) -> String {
    let layers = 4u64;
    let block_len = kv_bytes_per_token / layers * 16;
    let mut t = format!(
        r#"agent_id = "{name}"
node_addr = "{ip}"
http_listen = "{ip}:{http_port}"
socket_path = "{sock}"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
push_period_ms = 500

[probe]
period_ms = 200
num_regions = {layers}
num_blocks = 128
block_len_bytes = {block_len}
block_size_tokens = 16
small_blocks = 1
large_blocks = 64
max_bytes_per_s = 67108864

[[peers]]
name = "{peer}"
http = "{peer_http}"
"#,
        sock = socket.display()
    );
    if let Some(r) = router {
        t.push_str(&format!(
            r#"
[[routers]]
url = "http://{r}"
token = "{ADMIN_TOKEN}"

[[pairs]]
prefill_engine_id = "p0"
decode_engine_id = "d0"
decode_peer = "{peer}"
bytes_per_token = {kv_bytes_per_token}
block_size_tokens = 16
regions_per_block = {layers}
"#
        ));
    }
    t
}

/// The demo's binaries.
pub(super) struct Bins {
    /// `kvloop-engine-sim`.
    pub(super) sim: PathBuf,
    /// `kvloop-router`.
    pub(super) router: PathBuf,
    /// `kvloop-agent`.
    pub(super) agent: PathBuf,
}

/// The running agents and engines (stopped on drop, engines first).
pub(super) struct Cluster {
    /// P (node A).
    pub(super) p: ReadyChild,
    /// D (node B).
    pub(super) d: ReadyChild,
    /// `http://` URL of P.
    pub(super) p_url: String,
    /// `http://` URL of D.
    pub(super) d_url: String,
    /// The routers' configuration file (both engines).
    pub(super) router_config: PathBuf,
    /// Listen address of the adaptive mode's router (agent A pushes there).
    pub(super) adaptive_router: String,
    /// HTTP addresses (`host:port`) of agents A and B.
    pub(super) agent_http: [String; 2],
    /// Configuration files of agents A and B.
    pub(super) agent_configs: [PathBuf; 2],
    agents: Vec<ReadyChild>,
}

impl Cluster {
    /// Stops the engines, then the agents, and removes the agents' sockets.
    pub(super) fn stop(self) {
        let Cluster { p, d, agents, .. } = self;
        drop(p);
        drop(d);
        drop(agents);
        for side in ["a", "b"] {
            // An agent removes its socket on SIGTERM; a killed one leaves it.
            let _ = std::fs::remove_file(agent_socket(side));
        }
    }
}

/// The Unix socket of node `side`'s agent (`a` or `b`).
fn agent_socket(side: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvloop-demo-{}-{side}.sock", std::process::id()))
}

/// Starts both agents, then P and D registered with them, and writes the
/// routers' configuration under `--out-dir`.
pub(super) fn start(a: &DemoArgs, topo: &Topology, bins: &Bins, logs: &Path) -> Result<Cluster> {
    // Agents (one per node): they host the engines' KV memory (managed
    // mode), do their READs, probe the link and fit the cost model; agent A
    // pushes the (p0, d0) threshold to the adaptive router, whose address
    // is chosen now.
    let adaptive_router = format!("{}:{}", topo.ip_a, free_port(topo.ip_a)?);
    let (agents, agent_http) = start_agents(a, topo, &bins.agent, logs, &adaptive_router)?;
    let agent_configs = ["a", "b"].map(|s| a.out_dir.join(format!("agent-{s}.toml")));
    let (sock_a, sock_b) = (agent_socket("a"), agent_socket("b"));
    // Engines.
    let engine = |role: &str, id: &str, ip: IpAddr, node_b: bool| -> Result<ReadyChild> {
        let mut c = topo.cmd(node_b, &bins.sim);
        c.args(["--role", role, "--engine-id", id])
            .args(["--http-addr", &format!("{ip}:0")])
            .args(["--side-channel-addr", &format!("{ip}:0")])
            .args(["--profile", &a.profile])
            .args(["--time-scale", &a.time_scale.to_string()])
            .args(["--kv-mode", "agent", "--tokenizer", "pieces"])
            .arg("--agent-socket")
            .arg(if node_b { &sock_b } else { &sock_a })
            .args(["--kv-bytes-per-token", &a.kv_bytes_per_token.to_string()])
            .args(["--kv-capacity-tokens", &a.kv_capacity_tokens.to_string()])
            .args(["--decode-us-per-token", &a.decode_us_per_token.to_string()])
            .env("RUST_LOG", crate::demo::child_log_filter());
        ReadyChild::start(
            id,
            c,
            Some(&logs.join(format!("{id}.log"))),
            Duration::from_secs(30),
        )
    };
    let p = engine("prefill", "p0", topo.ip_a, false)?;
    let d = engine("decode", "d0", topo.ip_b, true)?;
    let p_url = format!("http://{}", p.get("http")?);
    let d_url = format!("http://{}", d.get("http")?);
    let p_side: SocketAddr = p.get("side_channel")?.parse()?;
    let d_side: SocketAddr = d.get("side_channel")?.parse()?;
    let router_config = a.out_dir.join("router.toml");
    std::fs::write(
        &router_config,
        router_toml(topo.ip_a, &p_url, p_side, &d_url, d_side),
    )?;
    Ok(Cluster {
        p,
        d,
        p_url,
        d_url,
        router_config,
        adaptive_router,
        agent_http,
        agent_configs,
        agents,
    })
}

/// Starts agent A (node of P, pushing to `adaptive_router`) and agent B;
/// returns them with their HTTP addresses.
fn start_agents(
    a: &DemoArgs,
    topo: &Topology,
    agent_bin: &Path,
    logs: &Path,
    adaptive_router: &str,
) -> Result<(Vec<ReadyChild>, [String; 2])> {
    let (port_a, port_b) = if topo.pair.is_some() {
        (9470, 9470)
    } else {
        (free_port(topo.ip_a)?, free_port(topo.ip_b)?)
    };
    let (sock_a, sock_b) = (agent_socket("a"), agent_socket("b"));
    let http_a = format!("{}:{port_a}", topo.ip_a);
    let http_b = format!("{}:{port_b}", topo.ip_b);
    let ta = agent_toml(
        "node-a",
        topo.ip_a,
        port_a,
        &sock_a,
        "node-b",
        &http_b,
        Some(adaptive_router),
        a.kv_bytes_per_token,
    );
    let tb = agent_toml(
        "node-b",
        topo.ip_b,
        port_b,
        &sock_b,
        "node-a",
        &http_a,
        None,
        a.kv_bytes_per_token,
    );
    let mut agents = Vec::new();
    for (name, toml, node_b) in [("agent-a", ta, false), ("agent-b", tb, true)] {
        let path = a.out_dir.join(format!("{name}.toml"));
        std::fs::write(&path, toml)?;
        let mut c = topo.cmd(node_b, agent_bin);
        c.arg("--config")
            .arg(&path)
            .env("RUST_LOG", crate::demo::child_log_filter());
        agents.push(ReadyChild::start(
            name,
            c,
            Some(&logs.join(format!("{name}.log"))),
            Duration::from_secs(60),
        )?);
    }
    println!(
        "agents: node-a {http_a}, node-b {http_b} (hosting the engines' KV, probing each other; node-a pushes to {adaptive_router})"
    );
    Ok((agents, [http_a, http_b]))
}

/// The routers' TOML: P and D, token prefix checks, listening on node A.
fn router_toml(
    ip_a: IpAddr,
    p_url: &str,
    p_side: SocketAddr,
    d_url: &str,
    d_side: SocketAddr,
) -> String {
    format!(
        r#"listen = "{ip_a}:0"
admin_token = "{ADMIN_TOKEN}"
prefix_check = "tokens"
health_interval_ms = 1000

[[engines]]
engine_id = "p0"
role = "prefill"
http_url = "{p_url}"
side_channel_host = "{p_host}"
side_channel_port = {p_port}
tp_size = 1
block_size_tokens = 16

[[engines]]
engine_id = "d0"
role = "decode"
http_url = "{d_url}"
side_channel_host = "{d_host}"
side_channel_port = {d_port}
tp_size = 1
block_size_tokens = 16
"#,
        p_host = p_side.ip(),
        p_port = p_side.port(),
        d_host = d_side.ip(),
        d_port = d_side.port(),
    )
}

/// Starts the router of `mode` with recompute threshold `threshold` (the
/// adaptive one on the address agent A pushes to).
pub(super) fn start_router(
    topo: &Topology,
    bins: &Bins,
    cluster: &Cluster,
    logs: &Path,
    mode: &str,
    threshold: u64,
) -> Result<ReadyChild> {
    let mut rc = topo.cmd(false, &bins.router);
    rc.arg("--config")
        .arg(&cluster.router_config)
        .args(["--kv-recompute-threshold", &threshold.to_string()])
        .env("RUST_LOG", crate::demo::child_log_filter());
    if mode == "adaptive" {
        rc.args(["--listen", &cluster.adaptive_router]);
    }
    ReadyChild::start(
        "router",
        rc,
        Some(&logs.join(format!("router-{mode}.log"))),
        Duration::from_secs(20),
    )
}
