//! Child processes of kvloop's tools and tests:
//!
//! - [`NodeChild`]: a `kvloop node` driven over stdin/stdout (used by
//!   `bench` and `demo dataplane`; tests drive the same binary the same way).
//! - [`ReadyChild`]: a daemon (`kvloop-agent`, `kvloop-router`,
//!   `kvloop-engine-sim`) that announces itself with one
//!   `READY key=value ...` line on stdout (used by `demo` and the
//!   end-to-end tests).
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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

/// A daemon started with its stdout piped, ready once it printed
/// `READY key=value ...`; stopped (SIGTERM, then SIGKILL after 1 s) on drop,
/// and killed by the kernel if this process dies first (`PR_SET_PDEATHSIG`).
pub struct ReadyChild {
    name: String,
    child: Child,
    ready: Vec<(String, String)>,
}

impl ReadyChild {
    /// Spawns `cmd` (stdout piped; stderr to the file `stderr`, or inherited
    /// when `None`) and waits up to `timeout` for its `READY` line. Later
    /// stdout lines are drained so the child never blocks on a full pipe.
    ///
    /// # Errors
    /// When it cannot start, or prints no `READY` line in time (the error
    /// names `name` and the log file).
    pub fn start(
        name: &str,
        mut cmd: Command,
        stderr: Option<&Path>,
        timeout: Duration,
    ) -> Result<Self> {
        let err = match stderr {
            Some(log) => Stdio::from(
                std::fs::File::create(log)
                    .with_context(|| format!("creating {}", log.display()))?,
            ),
            None => Stdio::inherit(),
        };
        // SAFETY: prctl in the child before exec; async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let out = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send(line);
            let mut sink = String::new();
            while r.read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        });
        let mut me = Self {
            name: name.to_string(),
            child,
            ready: Vec::new(),
        };
        let line = rx.recv_timeout(timeout).unwrap_or_default();
        if !line.starts_with("READY") {
            let log = stderr.map_or("its stderr above".to_string(), |l| l.display().to_string());
            bail!(
                "{name} did not start (no READY line within {timeout:?}; got {line:?}); see {log}"
            );
        }
        me.ready = line
            .split_whitespace()
            .skip(1)
            .filter_map(|p| {
                p.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        Ok(me)
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The value of `key` in the `READY` line.
    ///
    /// # Errors
    /// When the line has no such key.
    pub fn get(&self, key: &str) -> Result<String> {
        self.ready
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .with_context(|| format!("{}: READY line without {key}=", self.name))
    }

    /// Sends SIGTERM and waits up to `grace` for the process to exit, then
    /// kills it. Returns whether it exited by itself with status 0.
    pub fn terminate(&mut self, grace: Duration) -> bool {
        terminate(&mut self.child, grace).is_some_and(|st| st.success())
    }
}

/// Sends `child` SIGTERM (unless it already exited) and waits up to
/// `grace` for it, then SIGKILLs and reaps it. Returns its exit status when
/// it exited by itself, `None` when it had to be killed.
pub fn terminate(child: &mut Child, grace: Duration) -> Option<std::process::ExitStatus> {
    if let Ok(Some(st)) = child.try_wait() {
        return Some(st);
    }
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

impl ReadyChild {
    /// SIGKILL (no chance to clean up, as a crash), and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ReadyChild {
    fn drop(&mut self) {
        self.terminate(Duration::from_secs(1));
    }
}
