//! Issue 12 item 8: a node address peers cannot reach (loopback while a peer
//! is on another address) fails `--check` and refuses registrations, naming
//! `node_addr`, instead of handing out params every reader declines.
mod common;

use std::process::Command;

use common::{AgentProc, free_port};
use kvloop_agent::client::{AgentClient, ClientError};
use kvloop_dataplane::HostRegion;

fn toml(dir: &std::path::Path, http: u16, peer_http: &str) -> std::path::PathBuf {
    let p = dir.join("agent.toml");
    std::fs::write(
        &p,
        format!(
            r#"agent_id = "a"
node_addr = "127.0.0.1"
http_listen = "127.0.0.1:{http}"
socket_path = "{}/a.sock"
backend = {{ kind = "libfabric", provider = "tcp;ofi_rxm" }}
[probe]
enabled = false
[[peers]]
name = "b"
http = "{peer_http}"
"#,
            dir.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn check_fails_naming_node_addr_when_peers_are_on_other_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let p = toml(dir.path(), free_port("127.0.0.1"), "192.0.2.7:9470");
    let out = Command::new(env!("CARGO_BIN_EXE_kvloop-agent"))
        .arg("--config")
        .arg(&p)
        .arg("--check")
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!out.status.success(), "{v:#}");
    let part = &v["parts"]["side_channel"];
    assert_eq!(part["ok"], false, "{v:#}");
    assert_eq!(part["required"], true, "{v:#}");
    let detail = part["detail"].as_str().unwrap();
    assert!(
        detail.contains("node_addr") && detail.contains("192.0.2.7"),
        "{detail}"
    );

    // All on loopback (one host): the part passes.
    let p = toml(dir.path(), free_port("127.0.0.1"), "127.0.0.1:9");
    let out = Command::new(env!("CARGO_BIN_EXE_kvloop-agent"))
        .arg("--config")
        .arg(&p)
        .arg("--check")
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["parts"]["side_channel"]["ok"], true, "{v:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_refused_naming_node_addr() {
    let dir = tempfile::tempdir().unwrap();
    let p = toml(dir.path(), free_port("127.0.0.1"), "192.0.2.7:9470");
    let sock = dir.path().join("a.sock");
    let _agent = AgentProc::start(&[], &p, &sock);
    let c = AgentClient::connect(&sock, "t").await.unwrap();
    let layout = common::kv_layout(1, 4, 4096);
    let r = HostRegion::new("sc-test", layout.region_len_bytes() as usize).unwrap();
    match c.register_memfd("e0", layout, &[r], None).await {
        Err(ClientError::Api(e)) => {
            assert_eq!(e.kind.as_str(), "bad_request", "{e}");
            assert!(e.message.contains("node_addr"), "{e}");
        }
        other => panic!("expected a refusal naming node_addr, got {other:?}"),
    }
}
