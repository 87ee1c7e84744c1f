//! The agent binary's configuration from the environment, its own entry in
//! `peers`, path validity from the start, and eBPF enforcement / fallback
//! under a capability set without `CAP_SYS_ADMIN` (real processes, real
//! eBPF loads, real READs on loopback).
//!
//! The capability tests start the agent through util-linux's `setpriv
//! --bounding-set=-all,+…` as root (exec recomputes root's effective set from
//! the bounding set, as in a container with `capabilities: {drop: [ALL],
//! add: […]}`); they need root and setpriv and fail without them when
//! `CI=true`.
mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{AgentProc, free_port, get_json, get_text, require_root, require_tool};
use kvloop_agent::client::AgentClient;
use kvloop_agent::proto::{CudaIpcRegion, ReadDirection, RegionSource, Request};
use kvloop_dataplane::{BlockPair, HostRegion};

const AGENT: &str = env!("CARGO_BIN_EXE_kvloop-agent");
/// The DaemonSet's set without SYS_ADMIN, plus what loads eBPF programs and
/// tracepoints (but not uprobes on Linux >= 6.16).
const NO_SYS_ADMIN: &str = "-all,+ipc_lock,+sys_ptrace,+bpf,+perfmon";

fn print_config(toml: &str, env: &[(&str, &str)]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.toml");
    std::fs::write(&p, toml).unwrap();
    let mut c = Command::new(AGENT);
    c.arg("--config").arg(&p).arg("--print-config");
    c.env_remove("KVLOOP_AGENT_ROUTER_TOKEN");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

#[test]
fn router_token_comes_from_kvloop_agent_router_token() {
    let t = "[[routers]]\nurl = \"http://10.0.0.9:8000\"\n[[routers]]\nurl = \"http://10.0.0.10:8000\"\ntoken = \"file\"\n";
    let o = print_config(t, &[("KVLOOP_AGENT_ROUTER_TOKEN", "t0ken")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg: toml::Value = toml::from_str(&String::from_utf8_lossy(&o.stdout)).unwrap();
    let tokens: Vec<_> = cfg["routers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["token"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens, ["t0ken", "t0ken"]);
    // No token from either source: a config error naming the field.
    let o = print_config(t, &[]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("routers[0].token"), "{err}");
}

fn metric_lines(text: &str, name: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with(name))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_peer_entries_are_skipped_and_paths_are_valid_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let (ha, hb) = (free_port("127.0.0.1"), free_port("127.0.0.1"));
    let sock = dir.path().join("a.sock");
    // One shared peer list: this agent by name, by address under another
    // name, and a real peer (not running: its path is still configured).
    let text = format!(
        r#"
agent_id = "node-a"
node_addr = "127.0.0.1"
http_listen = "127.0.0.1:{ha}"
socket_path = "{}"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
[network]
enabled = false
[[peers]]
name = "node-a"
http = "127.0.0.1:{ha}"
[[peers]]
name = "alias-of-a"
http = "127.0.0.1:{ha}"
[[peers]]
name = "node-b"
http = "127.0.0.1:{hb}"
"#,
        sock.display()
    );
    let cfg = dir.path().join("a.toml");
    std::fs::write(&cfg, text).unwrap();
    let mut a = AgentProc::start(&[], &cfg, &sock);
    let m = get_text(&a.http, "/metrics").await;
    // Before any link changed state (the network watch is off entirely).
    assert_eq!(
        metric_lines(&m, "kvloop_agent_path_valid{"),
        ["kvloop_agent_path_valid{peer=\"node-b\"} 1"],
        "{m}"
    );
    let st: serde_json::Value = get_json(&a.http, "/v1/status").await;
    let peers: Vec<_> = st["peers"].as_object().unwrap().keys().cloned().collect();
    assert_eq!(peers, ["node-b"], "{st:#}");

    // GPU memory by CUDA IPC handle is refused with the reason (the
    // dataplane cannot wrap an IPC-opened pointer yet); the agent keeps
    // serving host memory.
    let c = AgentClient::connect(&sock, "test-cuda").await.unwrap();
    let layout = common::kv_layout(1, 4, 4096);
    let req = Request::Register {
        engine_id: "gpu0".into(),
        layout,
        regions: RegionSource::CudaIpc {
            regions: vec![CudaIpcRegion {
                device: 0,
                handle_hex: "00".repeat(64),
                len_bytes: 4 * 4096,
            }],
        },
        side_channel_port: None,
    };
    let e = c.call(&req, &[]).await.unwrap_err().to_string();
    assert!(e.contains("cuda_ipc") && e.contains("memfd"), "{e}");
    let mem = vec![HostRegion::new("cuda-refused-then-host", 4 * 4096).unwrap()];
    c.register_memfd("host0", layout, &mem, None).await.unwrap();
    drop(c);
    assert!(a.stop(), "agent exits cleanly on SIGTERM");
}

/// Fails the test unless it runs as root with util-linux's `setpriv`.
fn need_setpriv(test: &str) {
    require_root(test);
    require_tool(test, "setpriv", "util-linux");
}

fn agent_toml(dir: &std::path::Path, name: &str, http: u16, extra: &str) -> std::path::PathBuf {
    let text = format!(
        r#"
agent_id = "{name}"
node_addr = "127.0.0.1"
http_listen = "127.0.0.1:{http}"
socket_path = "{}"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
{extra}
[probe]
enabled = false
[network]
enabled = false
"#,
        dir.join(format!("{name}.sock")).display()
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
#[ignore = "needs root and util-linux's setpriv"]
fn require_ebpf_without_sys_admin_exits_naming_the_capability() {
    need_setpriv("require_ebpf_without_sys_admin_exits_naming_the_capability");
    let dir = tempfile::tempdir().unwrap();
    let cfg = agent_toml(
        dir.path(),
        "node-a",
        free_port("127.0.0.1"),
        "require_ebpf = true",
    );
    let mut child = Command::new("setpriv")
        .arg(format!("--bounding-set={NO_SYS_ADMIN}"))
        .arg("--")
        .arg(AGENT)
        .arg("--config")
        .arg(&cfg)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    if child.try_wait().unwrap().is_none() {
        let _ = child.kill();
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "agent kept running or exited 0:\n{err}"
    );
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("READY"),
        "{err}"
    );
    assert!(
        err.contains("require_ebpf: attaching READ probes to this process failed"),
        "{err}"
    );
    assert!(
        err.contains("missing capability CAP_SYS_ADMIN (uprobes need it on Linux ≥ 6.16)"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root and util-linux's setpriv"]
async fn without_sys_admin_the_agent_times_its_own_reads_in_user_space() {
    need_setpriv("without_sys_admin_the_agent_times_its_own_reads_in_user_space");
    let dir = tempfile::tempdir().unwrap();
    let (ha, hb) = (free_port("127.0.0.1"), free_port("127.0.0.1"));
    let ca = agent_toml(
        dir.path(),
        "node-a",
        ha,
        &format!("require_ebpf = false\n[[peers]]\nname = \"node-b\"\nhttp = \"127.0.0.1:{hb}\""),
    );
    let cb = agent_toml(dir.path(), "node-b", hb, "");
    let bounding = format!("--bounding-set={NO_SYS_ADMIN}");
    let mut a = AgentProc::start(
        &["setpriv", &bounding, "--"],
        &ca,
        &dir.path().join("node-a.sock"),
    );
    let mut b = AgentProc::start(&[], &cb, &dir.path().join("node-b.sock"));
    let st: serde_json::Value = get_json(&a.http, "/v1/status").await;
    assert_eq!(st["read_timing"], "userspace", "{st:#}");

    let layout = common::kv_layout(1, 4, 4096);
    let mem = |tag: &str| vec![HostRegion::new(tag, 4 * 4096).unwrap()];
    let (p_mem, d_mem) = (mem("fb-p"), mem("fb-d"));
    d_mem[0].write_at(4096, &[7u8; 4096]);
    let pa = AgentClient::connect(&a.socket, "test-p0").await.unwrap();
    let db = AgentClient::connect(&b.socket, "test-d0").await.unwrap();
    pa.register_memfd("p0", layout, &p_mem, None).await.unwrap();
    let d_sc = db.register_memfd("d0", layout, &d_mem, None).await.unwrap();
    assert_eq!(pa.connect_remote("p0", d_sc).await.unwrap(), "d0");
    let done = pa
        .read(
            "p0",
            "d0",
            vec![BlockPair {
                remote: 1,
                local: 2,
            }],
            ReadDirection::D2p,
            None,
            false,
            Some(10_000),
        )
        .await
        .unwrap();
    assert_eq!(done.bytes, 4096);
    let mut got = vec![0u8; 4096];
    p_mem[0].read_at(2 * 4096, &mut got);
    assert!(got.iter().all(|b| *b == 7), "the READ landed");
    let m = get_text(&a.http, "/metrics").await;
    let timed: Vec<_> = metric_lines(&m, "vllm:nixl_xfer_time_seconds_count{")
        .into_iter()
        .filter(|l| l.contains("peer=\"d0\""))
        .collect();
    assert_eq!(timed.len(), 1, "{m}");
    assert!(timed[0].contains("source=\"userspace\""), "{}", timed[0]);
    assert!(timed[0].ends_with(" 1"), "{}", timed[0]);
    assert!(a.stop() && b.stop(), "agents exit cleanly on SIGTERM");
}
