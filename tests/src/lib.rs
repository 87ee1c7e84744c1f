//! kvloop's test support, in one crate: child processes that announce
//! readiness ([`ReadyChild`], [`NodeChild`]), two "nodes" in network
//! namespaces ([`NodePair`]), several on one bridge ([`NodeStar`]), a real
//! `redis-server` ([`RedisServer`]), a demo held for the tools ([`held`]),
//! free ports, the lookup of the workspace's binaries, a process's CPU time
//! ([`process_cpu_s`]), and the policy for tests with a real dependency ([`deps`]).
//!
//! Policy (ARCHITECTURE.md, issue 11): a test that needs root, a tool or a
//! runtime is marked `#[ignore = "needs root (network namespaces)"]`-style,
//! `make test` runs it with `--include-ignored`, and when it runs without its
//! dependency it fails with what is missing (`require_*` below panic). No
//! test prints "SKIPPED" and passes.
//!
//! The `kvloop` CLI uses [`child`] and [`netns`] for its demos and benches
//! (re-exported as `kvloop_cli::child` / `kvloop_cli::netns`), so this crate
//! stays light: no dataplane, no probes.
pub mod child;
pub mod cpu;
pub mod deps;
pub mod held;
pub mod netns;
pub mod netns_star;
pub mod redis;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;

pub use child::{NodeChild, ReadyChild};
pub use cpu::process_cpu_s;
pub use deps::{
    have_root, in_ci, is_root, nixl_env, nixl_libs, require_gpu, require_root, require_tool,
};
pub use netns::NodePair;
pub use netns_star::{NodeStar, StarNode};
pub use redis::RedisServer;

/// Path of a workspace binary next to the running test (`target/<profile>/<name>`).
///
/// # Panics
/// When the binary has not been built, with the command that builds it.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: build the workspace binaries first (`cargo build --workspace --bins`, as `make test` does)",
        p.display()
    );
    p
}

/// First port [`free_port`] hands out (below Linux's default ephemeral
/// range, `net.ipv4.ip_local_port_range` 32768–60999).
const FREE_PORT_BASE: u16 = 20_000;
/// Ports [`free_port`] cycles through from [`FREE_PORT_BASE`].
const FREE_PORT_SPAN: u16 = 12_000;

/// A TCP port on `ip` that is free now, for a process the test starts
/// with that port in its configuration.
///
/// Taken below the kernel's ephemeral range: a port the kernel handed out
/// for `bind(…:0)` and released was often handed to another process of
/// the parallel tests (a listener bound to port 0, an outgoing connection)
/// before the test's process bound it (CI, 2026-12-07: an agent failed with
/// `Address already in use`, and an HTTP request reached a side channel).
/// Ports below that range are never handed out by the kernel; this
/// process walks them from a place set by its pid, so parallel test
/// processes rarely meet, and each port is checked bindable first.
///
/// # Panics
/// When no port of the span can be bound on `ip` (the address is not
/// local).
pub fn free_port(ip: &str) -> u16 {
    use std::sync::LazyLock;
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: LazyLock<AtomicU32> = LazyLock::new(|| {
        AtomicU32::new(
            (std::process::id().wrapping_mul(2_654_435_761) >> 8) % u32::from(FREE_PORT_SPAN),
        )
    });
    for _ in 0..FREE_PORT_SPAN {
        let k = NEXT.fetch_add(1, Ordering::Relaxed) % u32::from(FREE_PORT_SPAN);
        let port = FREE_PORT_BASE + k as u16;
        if TcpListener::bind((ip, port)).is_ok() {
            return port;
        }
    }
    panic!(
        "no free port on {ip} in {FREE_PORT_BASE}..{}",
        FREE_PORT_BASE + FREE_PORT_SPAN
    )
}

/// The configuration of a `kvloop-agent` on loopback for the end-to-end
/// tests: agent `name` on HTTP port `http` with its local API on `socket`,
/// tcp;ofi_rxm, a 1 s lease safety margin, a probe every second, and one
/// peer `peer` at `127.0.0.1:peer_http`.
pub fn loopback_agent_toml(
    name: &str,
    http: u16,
    socket: &std::path::Path,
    peer: &str,
    peer_http: u16,
) -> String {
    loopback_agent_toml_with(
        name,
        http,
        socket,
        (peer, peer_http),
        "",
        "[lease]\nsafety_margin_ms = 1000\n[probe]\nperiod_ms = 1000\nlarge_blocks = 4\n",
    )
}

/// [`loopback_agent_toml`]'s agent, peer and backend with the caller's
/// `top` (top-level keys, e.g. `push_period_ms = 300`) and `tables` (TOML
/// tables, e.g. `[probe]`) in place of its lease and probe settings.
pub fn loopback_agent_toml_with(
    name: &str,
    http: u16,
    socket: &std::path::Path,
    (peer, peer_http): (&str, u16),
    top: &str,
    tables: &str,
) -> String {
    format!(
        r#"agent_id = "{name}"
node_addr = "127.0.0.1"
http_listen = "127.0.0.1:{http}"
socket_path = "{}"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
{top}
[[peers]]
name = "{peer}"
http = "127.0.0.1:{peer_http}"
{tables}
"#,
        socket.display()
    )
}

/// `kvloop node <args>` as a command, optionally inside a namespace.
pub fn node_cmd(ns: Option<&str>, args: &[String]) -> Command {
    let kvloop = bin("kvloop");
    let mut c = match ns {
        Some(ns) => NodePair::command_in(ns, &kvloop),
        None => Command::new(kvloop),
    };
    c.arg("node").args(args);
    c
}

/// Engine flags for a test node: `blocks` blocks of `block_bytes` bytes in
/// each of 2 regions, filled with the pattern of `tag`.
pub fn node_args(
    engine_id: &str,
    listen: &str,
    backend: &str,
    provider: &str,
    blocks: u32,
    block_bytes: u64,
    tag: u64,
) -> Vec<String> {
    [
        "--engine-id",
        engine_id,
        "--listen",
        listen,
        "--backend",
        backend,
        "--provider",
        provider,
        "--num-regions",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--num-blocks".into(),
        blocks.to_string(),
        "--block-bytes".into(),
        block_bytes.to_string(),
        "--fill-tag".into(),
        tag.to_string(),
    ])
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_bindable_distinct_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port("127.0.0.1")).collect();
        for &p in &ports {
            assert!(
                (FREE_PORT_BASE..FREE_PORT_BASE + FREE_PORT_SPAN).contains(&p),
                "{p}"
            );
            TcpListener::bind(("127.0.0.1", p)).expect("the port is free");
        }
        let mut d = ports.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), ports.len(), "{ports:?}");
    }

    #[test]
    fn node_args_name_every_flag() {
        let a = node_args("e", "127.0.0.1:0", "nixl", "tcp", 4, 4096, 7);
        assert_eq!(a[a.len() - 1], "7");
        assert!(a.windows(2).any(|w| w == ["--num-blocks", "4"]));
    }
}
