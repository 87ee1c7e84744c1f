//! `kvloop doctor` against real processes, each check's failure injected:
//! a loopback side channel of a real agent while a peer is elsewhere, a
//! wrong token against a real kvloop-router, a missing plugin directory,
//! CAP_SYS_ADMIN dropped with setpriv (capabilities and uprobes on a real
//! `kvloop node`), a memlock limit without CAP_IPC_LOCK.
mod common;

use std::time::Duration;

use common::*;
use kvloop_tests::held::doctor_check as check;
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// Runs `kvloop doctor --json ARGS`; returns (exit code, report).
fn doctor(wrapper: &[&str], args: &[&str]) -> (i32, Value) {
    let mut a = vec!["doctor", "--json", "--timeout-ms", "500"];
    a.extend_from_slice(args);
    let o = kvloop(wrapper, &a, T);
    let out = String::from_utf8_lossy(&o.stdout);
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| {
        panic!(
            "doctor printed no JSON ({e}): {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        )
    });
    let code = o.status.code().expect("exit code");
    assert_eq!(v["exit_code"], code, "{v}");
    (code, v)
}

fn level(v: &Value, name: &str) -> String {
    check(v, name)["level"].as_str().unwrap().to_string()
}

#[test]
fn loopback_side_channel_of_a_real_agent_fails_while_a_peer_is_remote() {
    let dir = tempfile::tempdir().unwrap();
    // The peer is on another host (a TEST-NET-1 address nothing answers).
    let (_a, cfg) = agent(
        dir.path(),
        "node-a",
        "[[peers]]\nname = \"node-b\"\nhttp = \"192.0.2.1:9470\"",
    );
    let (code, v) = doctor(&[], &["--config", cfg.to_str().unwrap()]);
    let sc = check(&v, "side_channel");
    assert_eq!(sc["level"], "fail", "{sc}");
    assert!(sc["detail"].as_str().unwrap().contains("127.0.0.1"), "{sc}");
    assert!(sc["fix"].as_str().unwrap().contains("node_addr"), "{sc}");
    assert_eq!(code, 2);
    // The unreachable peer's clock is a warning, not a pass.
    assert_eq!(level(&v, "clock"), "warn", "{v}");

    // Every peer local: loopback is right.
    let (b, _) = agent(dir.path(), "node-b", "");
    let (_c, cfg) = agent(
        dir.path(),
        "node-c",
        &format!("[[peers]]\nname = \"node-b\"\nhttp = \"{}\"", b.http),
    );
    let (_, v) = doctor(&[], &["--config", cfg.to_str().unwrap()]);
    assert_eq!(level(&v, "side_channel"), "pass", "{v}");
    assert_eq!(level(&v, "clock"), "pass", "{v}");
}

#[test]
fn wrong_router_token_fails_against_a_real_router() {
    let dir = tempfile::tempdir().unwrap();
    let r = router(dir.path(), "right-token");
    let cfg = |tok: &str| {
        agent_toml(
            dir.path(),
            &format!("agent-{tok}"),
            free_port(),
            &format!(
                "[[routers]]\nurl = \"http://{}\"\ntoken = \"{tok}\"",
                r.http
            ),
        )
    };
    let wrong = cfg("wrong-token");
    let (code, v) = doctor(&[], &["--config", wrong.to_str().unwrap()]);
    let c = check(&v, "routers");
    assert_eq!(c["level"], "fail", "{c}");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("token refused (401)"),
        "{c}"
    );
    assert!(c["fix"].as_str().unwrap().contains("admin_token"), "{c}");
    assert_eq!(code, 2);
    let right = cfg("right-token");
    let (_, v) = doctor(&[], &["--config", right.to_str().unwrap()]);
    let c = check(&v, "routers");
    assert_eq!(c["level"], "pass", "{c}");
    assert!(
        c["detail"].as_str().unwrap().contains("token accepted"),
        "{c}"
    );
    // A router that is not there.
    let gone = agent_toml(
        dir.path(),
        "agent-gone",
        free_port(),
        &format!(
            "[[routers]]\nurl = \"http://127.0.0.1:{}\"\ntoken = \"t\"",
            free_port()
        ),
    );
    let (_, v) = doctor(&[], &["--config", gone.to_str().unwrap()]);
    let c = check(&v, "routers");
    assert_eq!(c["level"], "fail", "{c}");
    assert!(c["detail"].as_str().unwrap().contains("unreachable"), "{c}");
}

#[test]
fn missing_plugin_directory_fails_with_a_nixl_backend() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("a.toml");
    std::fs::write(
        &cfg,
        "backend = { kind = \"nixl\", plugin = \"LIBFABRIC\" }\n",
    )
    .unwrap();
    let missing = dir.path().join("no-such-plugins");
    let (code, v) = doctor(
        &[],
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--nixl-plugin-dir",
            missing.to_str().unwrap(),
        ],
    );
    let c = check(&v, "nixl_plugins");
    assert_eq!(c["level"], "fail", "{c}");
    assert!(
        c["detail"].as_str().unwrap().contains("no-such-plugins"),
        "{c}"
    );
    assert_eq!(code, 2);
    // A directory holding the plugin passes.
    let ok = dir.path().join("plugins");
    std::fs::create_dir(&ok).unwrap();
    std::fs::write(ok.join("libplugin_LIBFABRIC.so"), b"").unwrap();
    let (_, v) = doctor(
        &[],
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--nixl-plugin-dir",
            ok.to_str().unwrap(),
        ],
    );
    assert_eq!(level(&v, "nixl_plugins"), "pass", "{v}");
}

#[test]
fn no_efa_device_here_is_a_warning() {
    let has_efa = std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some());
    assert!(!has_efa, "this test describes a node without RDMA devices");
    let (_, v) = doctor(&[], &[]);
    let c = check(&v, "efa");
    assert_eq!(c["level"], "warn", "{c}");
    assert!(
        c["detail"].as_str().unwrap().contains("no EFA device"),
        "{c}"
    );
    assert_eq!(level(&v, "uprobes"), "skip");
}

/// A `kvloop node` (it has kvloop's READ sites) to attach uprobes to.
fn engine_process() -> kvloop_cli::child::NodeChild {
    let mut cmd = std::process::Command::new(KVLOOP);
    cmd.args([
        "node",
        "--engine-id",
        "doctor-target",
        "--num-blocks",
        "2",
        "--block-bytes",
        "4096",
    ]);
    kvloop_cli::child::NodeChild::spawn(cmd).expect("kvloop node")
}

#[test]
#[ignore = "needs root (setpriv --bounding-set, eBPF uprobes) and util-linux setpriv"]
fn sys_admin_dropped_with_setpriv_fails_capabilities_and_uprobes() {
    need_root("sys_admin_dropped_with_setpriv_fails_capabilities_and_uprobes");
    need_tool("setpriv");
    let node = engine_process();
    let pid = node.ready["pid"].to_string();
    // With every capability: the uprobes attach.
    let (_, v) = doctor(&[], &["--pid", &pid]);
    let c = check(&v, "uprobes");
    assert_eq!(c["level"], "pass", "{c}");
    assert_eq!(level(&v, "capabilities"), "pass", "{v}");
    // CAP_SYS_ADMIN dropped (kernel >= 6.16 here: uprobes need it).
    let (code, v) = doctor(
        &[
            "setpriv",
            "--inh-caps=-all",
            "--bounding-set=-sys_admin",
            "--",
        ],
        &["--pid", &pid],
    );
    let caps = check(&v, "capabilities");
    assert_eq!(caps["level"], "fail", "{caps}");
    assert!(
        caps["detail"]
            .as_str()
            .unwrap()
            .contains("missing CAP_SYS_ADMIN"),
        "{caps}"
    );
    let u = check(&v, "uprobes");
    assert_eq!(u["level"], "fail", "{u}");
    assert!(u["fix"].as_str().unwrap().contains("CAP_SYS_ADMIN"), "{u}");
    assert_eq!(code, 2);
}

#[test]
#[ignore = "needs root (setpriv --bounding-set) and util-linux setpriv, prlimit"]
fn memlock_limit_without_ipc_lock_warns() {
    need_root("memlock_limit_without_ipc_lock_warns");
    need_tool("setpriv");
    need_tool("prlimit");
    let (_, v) = doctor(
        &[
            "prlimit",
            "--memlock=65536:65536",
            "--",
            "setpriv",
            "--inh-caps=-all",
            "--bounding-set=-ipc_lock",
            "--",
        ],
        &[],
    );
    let c = check(&v, "memlock");
    // No EFA here: a warning (EFA would make it a failure, see the unit tests).
    assert_eq!(c["level"], "warn", "{c}");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("64 KiB without CAP_IPC_LOCK"),
        "{c}"
    );
    let (_, v) = doctor(&[], &[]);
    assert_eq!(level(&v, "memlock"), "pass", "{v}");
}
