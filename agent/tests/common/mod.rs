//! Helpers of the agent's integration tests: start real `kvloop-agent`
//! processes and wait for their `READY` line.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvloop_cli::child::ReadyChild;

// Shared with the workspace's end-to-end tests (`tests/src/lib.rs`):
// dependency policy (a test without its dependency fails) and binary lookup.
// Each test file includes this module and uses a different subset.
#[allow(unused_imports)]
pub use kvloop_tests::{
    bin as workspace_bin, free_port, have_root, in_ci, require_root, require_tool,
};

/// A running agent process.
pub struct AgentProc {
    child: ReadyChild,
    /// Its HTTP address.
    pub http: String,
    /// Its socket.
    pub socket: PathBuf,
}

impl AgentProc {
    /// Starts `kvloop-agent --config <cfg>` (optionally through a wrapper
    /// command such as `ip netns exec NS`) and waits for `READY`.
    pub fn start(wrapper: &[&str], config: &Path, socket: &Path) -> Self {
        let bin = PathBuf::from(env!("CARGO_BIN_EXE_kvloop-agent"));
        let mut cmd = if wrapper.is_empty() {
            Command::new(&bin)
        } else {
            let mut c = Command::new(wrapper[0]);
            c.args(&wrapper[1..]).arg(&bin);
            c
        };
        cmd.arg("--config").arg(config);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn,kvloop_agent=info");
        }
        let child = ReadyChild::start("kvloop-agent", cmd, None, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let http = child.get("http").expect("http= in READY");
        Self {
            child,
            http,
            socket: socket.to_path_buf(),
        }
    }

    /// Sends SIGTERM and waits (bounded) for a clean exit; returns whether
    /// it exited by itself.
    pub fn stop(&mut self) -> bool {
        self.child.terminate(Duration::from_secs(5))
    }
}

/// Writes `<dir>/<name>.toml`, the workspace tests' loopback agent
/// ([`kvloop_tests::loopback_agent_toml_with`]) with its socket at
/// `<dir>/<name>.sock`, and returns its path.
pub fn loopback_agent_toml(
    dir: &Path,
    name: &str,
    (http, peer, peer_http): (u16, &str, u16),
    top: &str,
    tables: &str,
) -> PathBuf {
    let sock = dir.join(format!("{name}.sock"));
    let text =
        kvloop_tests::loopback_agent_toml_with(name, http, &sock, (peer, peer_http), top, tables);
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// Two agents on loopback, `node-a` and `node-b`, each the other's only
/// peer, on free ports, configured by `config(dir, name, http, peer,
/// peer_http)` (which writes the file and returns its path).
pub fn start_two_agents(
    dir: &Path,
    config: impl Fn(&Path, &str, u16, &str, u16) -> PathBuf,
) -> (AgentProc, AgentProc) {
    let (ha, hb) = (free_port("127.0.0.1"), free_port("127.0.0.1"));
    let ca = config(dir, "node-a", ha, "node-b", hb);
    let cb = config(dir, "node-b", hb, "node-a", ha);
    let a = AgentProc::start(&[], &ca, &dir.join("node-a.sock"));
    let b = AgentProc::start(&[], &cb, &dir.join("node-b.sock"));
    (a, b)
}

/// Two agents in the namespaces of `pair`, `node-a` in A and `node-b` in
/// B, each the other's only peer, configured by `config(dir, name, addr,
/// peer, peer_addr)` (which writes `<dir>/<name>.toml` with its socket at
/// `<dir>/<name>.sock` and returns the file's path).
pub fn start_netns_agents(
    pair: &kvloop_cli::netns::NodePair,
    dir: &Path,
    config: impl Fn(&Path, &str, &str, &str, &str) -> PathBuf,
) -> (AgentProc, AgentProc) {
    let (a, b) = (pair.addr_a.to_string(), pair.addr_b.to_string());
    let start = |ns: &str, name: &str, addr: &str, peer: &str, peer_addr: &str| {
        let cfg = config(dir, name, addr, peer, peer_addr);
        let sock = dir.join(format!("{name}.sock"));
        AgentProc::start(&["ip", "netns", "exec", ns], &cfg, &sock)
    };
    (
        start(&pair.ns_a, "node-a", &a, "node-b", &b),
        start(&pair.ns_b, "node-b", &b, "node-a", &a),
    )
}

/// Starts `kvloop-router` inside namespace `ns`, listening on `listen`
/// with admin token `token`, engines p0 (prefill) and d0 (decode) at
/// addresses where nothing answers: enough for the agents' pushes and
/// notices, not for chat requests.
pub fn start_router_in_ns(dir: &Path, ns: &str, listen: &str, token: &str) -> ReadyChild {
    let cfg = dir.join("router.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
listen = "{listen}"
admin_token = "{token}"
[[engines]]
engine_id = "p0"
role = "prefill"
http_url = "http://127.0.0.1:1"
side_channel_host = "127.0.0.1"
side_channel_port = 5600
[[engines]]
engine_id = "d0"
role = "decode"
http_url = "http://127.0.0.1:2"
side_channel_host = "127.0.0.1"
side_channel_port = 5601
"#
        ),
    )
    .unwrap();
    let mut c = kvloop_cli::netns::NodePair::command_in(ns, &workspace_bin("kvloop-router"));
    c.arg("--config").arg(&cfg);
    c.env("RUST_LOG", "warn");
    ReadyChild::start("kvloop-router", c, None, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// `GET http://<http><path>`'s body as text (e.g. `/metrics`).
pub async fn get_text(http: &str, path: &str) -> String {
    reqwest::get(format!("http://{http}{path}"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// `GET http://<http><path>`'s body as JSON (e.g. `/v1/status`).
pub async fn get_json(http: &str, path: &str) -> serde_json::Value {
    reqwest::get(format!("http://{http}{path}"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// HTTP GET from inside namespace `ns` (a thread that joined it).
pub fn get_in_ns(ns: &str, addr: &str, path: &str, token: Option<&str>) -> Option<(u16, String)> {
    let ns = ns.to_string();
    let addr = addr.to_string();
    let path = path.to_string();
    let token = token.map(|s| s.to_string());
    std::thread::spawn(move || {
        let f = std::fs::File::open(format!("/var/run/netns/{ns}")).ok()?;
        nix::sched::setns(
            std::os::fd::AsFd::as_fd(&f),
            nix::sched::CloneFlags::CLONE_NEWNET,
        )
        .ok()?;
        let mut s =
            std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2))
                .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        std::io::Write::write_fmt(
            &mut s,
            format_args!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"),
        )
        .ok()?;
        let mut raw = Vec::new();
        std::io::Read::read_to_end(&mut s, &mut raw).ok()?;
        let text = String::from_utf8_lossy(&raw).to_string();
        let (head, body) = text.split_once("\r\n\r\n")?;
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((status, body.to_string()))
    })
    .join()
    .ok()?
}

/// A KV layout of `num_regions` regions of `num_blocks` blocks of
/// `block_len_bytes`, 16 tokens per block: the agent tests' engines.
pub fn kv_layout(
    num_regions: u32,
    num_blocks: u32,
    block_len_bytes: u64,
) -> kvloop_dataplane::KvLayout {
    kvloop_dataplane::KvLayout {
        num_regions,
        num_blocks,
        block_len_bytes,
        block_size_tokens: 16,
    }
}

/// Host KV regions of `layout`, every block filled with
/// `kvloop_cli::pattern` of (`tag`, region, block), named `<name>{tag}-{r}`.
pub fn patterned_regions(
    name: &str,
    layout: &kvloop_dataplane::KvLayout,
    tag: u64,
) -> Vec<kvloop_dataplane::HostRegion> {
    let block = layout.block_len_bytes;
    (0..u64::from(layout.num_regions))
        .map(|r| {
            let reg = kvloop_dataplane::HostRegion::new(
                &format!("{name}{tag}-{r}"),
                layout.region_len_bytes() as usize,
            )
            .unwrap();
            let mut buf = vec![0u8; block as usize];
            for b in 0..u64::from(layout.num_blocks) {
                kvloop_cli::pattern::fill(tag, r, b, &mut buf);
                reg.write_at((b * block) as usize, &buf);
            }
            reg
        })
        .collect()
}
