//! `kvloop-agent --check`: readiness JSON and exit status.
use std::process::Command;

fn check(config: &str) -> (bool, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("agent.toml");
    std::fs::write(
        &p,
        format!(
            "agent_id = \"c\"\nsocket_path = \"{}/s.sock\"\n{config}",
            dir.path().display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvloop-agent"))
        .arg("--config")
        .arg(&p)
        .arg("--check")
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "--check prints JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.success(), v)
}

#[test]
fn ready_with_a_working_provider() {
    let (ok, v) = check("backend = { kind = \"libfabric\", provider = \"tcp;ofi_rxm\" }\n");
    assert!(ok, "{v:#}");
    assert_eq!(v["ready"], true);
    assert_eq!(v["parts"]["backend"]["ok"], true, "{v:#}");
    for part in ["ebpf", "privilege", "socket_dir"] {
        assert!(v["parts"][part]["detail"].is_string(), "{part}: {v:#}");
    }
}

#[test]
fn not_ready_and_non_zero_when_the_provider_is_missing() {
    let (ok, v) = check("backend = { kind = \"libfabric\", provider = \"no-such-provider\" }\n");
    assert!(!ok, "{v:#}");
    assert_eq!(v["ready"], false);
    assert_eq!(v["parts"]["backend"]["ok"], false);
    assert_eq!(v["parts"]["backend"]["required"], true);
}

#[test]
fn bad_config_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("agent.toml");
    std::fs::write(&p, "push_period_ms = 0\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvloop-agent"))
        .arg("--config")
        .arg(&p)
        .arg("--check")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("push_period_ms"), "{err}");
}
