//! Helpers of the agent's integration tests: start real `kvloop-agent`
//! processes and wait for their `READY` line.
#![allow(dead_code)]
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

// Shared with the workspace's end-to-end tests (`tests/src/lib.rs`): CI
// policy (a missing real dependency fails under CI=true) and binary lookup.
// Each test file includes this module and uses a different subset.
#[allow(unused_imports)]
pub use kvloop_tests::{bin as workspace_bin, have_root, in_ci};

/// A free TCP port on `ip` (bound then released).
pub fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running agent process.
pub struct AgentProc {
    child: Child,
    /// Its HTTP address.
    pub http: String,
    /// Its socket.
    pub socket: PathBuf,
    lines: mpsc::Receiver<String>,
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
            cmd.env(
                "RUST_LOG",
                "warn,kvloop_agent=info,netlink_packet_route=error",
            );
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvloop-agent");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("kvloop-agent READY line within 60 s");
        assert!(line.starts_with("READY "), "unexpected first line: {line}");
        let http = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http="))
            .expect("http=")
            .to_string();
        Self {
            child,
            http,
            socket: socket.to_path_buf(),
            lines: rx,
        }
    }

    /// Sends SIGTERM and waits (bounded) for a clean exit; returns whether
    /// it exited by itself.
    pub fn stop(&mut self) -> bool {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..100 {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        false
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
