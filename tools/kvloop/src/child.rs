//! A `kvloop node` child process driven over stdin/stdout (used by `bench`
//! and `demo`; tests drive the same binary the same way).
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// A running `kvloop node`.
pub struct NodeChild {
    child: Child,
    stdin: ChildStdin,
    events: mpsc::Receiver<Value>,
    /// The `ready` event.
    pub ready: Value,
}

impl NodeChild {
    /// Spawns `cmd` (a `kvloop node ...` command line, maybe under `ip netns
    /// exec`) and waits for its `ready` event.
    pub fn spawn(mut cmd: Command) -> Result<Self> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning kvloop node")?;
        let stdin = child.stdin.take().unwrap();
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && tx.send(v).is_err()
                {
                    break;
                }
            }
        });
        let mut me = Self {
            child,
            stdin,
            events: rx,
            ready: Value::Null,
        };
        me.ready = me.wait_event("ready", Duration::from_secs(20))?;
        Ok(me)
    }

    /// The node's side-channel address.
    pub fn side_channel(&self) -> String {
        self.ready["side_channel"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Sends one command.
    pub fn send(&mut self, cmd: &Value) -> Result<()> {
        writeln!(self.stdin, "{cmd}").context("writing to kvloop node")?;
        self.stdin.flush().context("flushing kvloop node stdin")
    }

    /// Waits for the next event named `name` (others are skipped).
    pub fn wait_event(&mut self, name: &str, timeout: Duration) -> Result<Value> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.events.recv_timeout(left) {
                Ok(v) if v["event"] == name => return Ok(v),
                Ok(v) if v["event"] == "error" => bail!("kvloop node error: {}", v["error"]),
                Ok(_) => continue,
                Err(_) => bail!("no `{name}` event from kvloop node within {timeout:?}"),
            }
        }
    }

    /// Kills the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NodeChild {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{{\"cmd\":\"quit\"}}");
        std::thread::sleep(Duration::from_millis(20));
        self.kill();
    }
}
