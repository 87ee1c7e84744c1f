//! Helpers of kvloop's own integration tests (`doctor`, `ping`): real
//! `kvloop-agent` / `kvloop-router` processes on loopback, found next to
//! the `kvloop` binary under test (build them first:
//! `cargo build -p kvloop-agent -p kvloop-router`).
#![allow(dead_code)]
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use kvloop_cli::child::ReadyChild;

/// The `kvloop` binary under test.
pub const KVLOOP: &str = env!("CARGO_BIN_EXE_kvloop");

/// A workspace binary next to `kvloop` (`target/debug/NAME`); panics naming
/// the build command when it is missing.
pub fn sibling(name: &str) -> PathBuf {
    let p = Path::new(KVLOOP).with_file_name(name);
    assert!(
        p.exists(),
        "{} missing: run `cargo build -p {name}` before these tests",
        p.display()
    );
    p
}

/// A free TCP port on 127.0.0.1 ([`kvloop_tests::free_port`]).
pub fn free_port() -> u16 {
    kvloop_tests::free_port("127.0.0.1")
}

/// A daemon printing `READY http=...`.
pub struct Daemon {
    child: ReadyChild,
    /// Its `http=` address.
    pub http: String,
}

impl Daemon {
    /// Starts `bin --config cfg` (through `wrapper` when not empty).
    pub fn start(bin: &str, cfg: &Path, log: &Path) -> Self {
        let mut cmd = Command::new(sibling(bin));
        cmd.arg("--config").arg(cfg).env("RUST_LOG", "warn");
        let child =
            ReadyChild::start(bin, cmd, Some(log), Duration::from_secs(60)).unwrap_or_else(|e| {
                panic!(
                    "{e:#}: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            });
        let http = child.get("http").unwrap();
        Self { child, http }
    }
}

/// Writes an agent configuration `NAME.toml` in `dir` listening on
/// 127.0.0.1:`http`, with `extra` TOML (before the `[network]` table),
/// and returns its path.
pub fn agent_toml(dir: &Path, name: &str, http: u16, extra: &str) -> PathBuf {
    let text = format!(
        "agent_id = \"{name}\"\nnode_addr = \"127.0.0.1\"\nhttp_listen = \"127.0.0.1:{http}\"\n\
         socket_path = \"{}\"\nbackend = {{ kind = \"libfabric\", provider = \"tcp;ofi_rxm\" }}\n\
         {extra}\n[network]\nenabled = false\n",
        dir.join(format!("{name}.sock")).display()
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// Starts an agent from [`agent_toml`].
pub fn agent(dir: &Path, name: &str, extra: &str) -> (Daemon, PathBuf) {
    let cfg = agent_toml(dir, name, free_port(), extra);
    let d = Daemon::start("kvloop-agent", &cfg, &dir.join(format!("{name}.log")));
    (d, cfg)
}

/// A thread answering `200 ok` to every HTTP request on a free port (a
/// stand-in engine `/health` for the router); returns its base URL.
pub fn ok_server() -> String {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut s = s;
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ =
                s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
        }
    });
    url
}

/// Starts a router with `admin_token` whose prefill and decode engines
/// answer `/health` (so that its own `/health` turns 200).
pub fn router(dir: &Path, token: &str) -> Daemon {
    let (p, d) = (ok_server(), ok_server());
    let text = format!(
        "listen = \"127.0.0.1:{}\"\nadmin_token = \"{token}\"\nhealth_interval_ms = 100\n\
         [[engines]]\nengine_id = \"p0\"\nrole = \"prefill\"\nhttp_url = \"{p}\"\n\
         side_channel_host = \"127.0.0.1\"\nside_channel_port = 1\n\
         [[engines]]\nengine_id = \"d0\"\nrole = \"decode\"\nhttp_url = \"{d}\"\n\
         side_channel_host = \"127.0.0.1\"\nside_channel_port = 2\n",
        free_port()
    );
    let cfg = dir.join("router.toml");
    std::fs::write(&cfg, text).unwrap();
    let r = Daemon::start("kvloop-router", &cfg, &dir.join("router.log"));
    // Bounded wait for the first health round.
    for _ in 0..50 {
        let ok = std::net::TcpStream::connect(&r.http)
            .ok()
            .and_then(|mut s| {
                s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .ok()?;
                let mut out = String::new();
                s.read_to_string(&mut out).ok()?;
                Some(out.starts_with("HTTP/1.1 200"))
            });
        if ok == Some(true) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    r
}

/// Runs `kvloop ARGS` (optionally behind `wrapper`, e.g. `setpriv ...`),
/// bounded by `timeout`.
pub fn kvloop(wrapper: &[&str], args: &[&str], timeout: Duration) -> Output {
    let mut cmd = if wrapper.is_empty() {
        Command::new(KVLOOP)
    } else {
        let mut c = Command::new(wrapper[0]);
        c.args(&wrapper[1..]).arg(KVLOOP);
        c
    };
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("spawning kvloop");
    let deadline = std::time::Instant::now() + timeout;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "kvloop {args:?} ran past {timeout:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Panics unless running as root (`test` names the test).
pub fn need_root(test: &str) {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "{test} needs root (setpriv --bounding-set, eBPF)");
}

/// Panics unless `tool` runs (`--version`, or `-V` as tmux has it).
pub fn need_tool(tool: &str) {
    let runs = |flag: &str| {
        Command::new(tool)
            .arg(flag)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    assert!(runs("--version") || runs("-V"), "this test needs `{tool}`");
}
