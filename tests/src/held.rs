//! A demo run with `--hold` in the background (`kvloop demo --hold`,
//! `kvloop demo cluster --hold`) and the operator tools run against it
//! inside its namespaces, as `hold.json` lists them (issue 16's tests).
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::bin;

/// A held demo: its process and output directory (stdout and stderr in
/// `stdout.txt` there). Dropping it sends SIGTERM and waits (bounded), then
/// SIGKILLs.
pub struct HeldDemo {
    /// The `kvloop demo` process.
    pub child: Child,
    /// Its `--out-dir`.
    pub out: PathBuf,
}

impl HeldDemo {
    /// Starts `kvloop ARGS --hold --out-dir OUT` (`OUT` emptied first).
    ///
    /// # Panics
    /// When the process cannot start.
    pub fn start(args: &[&str], out: &Path) -> Self {
        let _ = std::fs::remove_dir_all(out);
        std::fs::create_dir_all(out).unwrap();
        let log = std::fs::File::create(out.join("stdout.txt")).unwrap();
        let child = Command::new(bin("kvloop"))
            .args(args)
            .args(["--hold", "--hold-max-s", "600", "--out-dir"])
            .arg(out)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting kvloop demo --hold");
        Self {
            child,
            out: out.to_path_buf(),
        }
    }

    /// What it printed so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.out.join("stdout.txt")).unwrap_or_default()
    }

    /// Waits up to `limit` for `hold.json` and returns it.
    ///
    /// # Panics
    /// When the demo exits first or `limit` passes, with what it printed.
    pub fn wait_held(&mut self, limit: Duration) -> Value {
        let path = self.out.join("hold.json");
        let end = Instant::now() + limit;
        loop {
            if let Ok(s) = std::fs::read_to_string(&path)
                && let Ok(v) = serde_json::from_str::<Value>(&s)
            {
                return v;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("the demo exited ({st}) before holding:\n{}", self.stdout());
            }
            assert!(
                Instant::now() < end,
                "no hold.json within {limit:?}:\n{}",
                self.stdout()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// SIGTERM, then waits up to 60 s for the exit status.
    ///
    /// # Panics
    /// When it does not exit in time (it is then killed).
    pub fn stop(&mut self) -> std::process::ExitStatus {
        crate::child::terminate(&mut self.child, Duration::from_secs(60))
            .expect("the demo did not stop within 60 s")
    }
}

impl Drop for HeldDemo {
    fn drop(&mut self) {
        let _ = crate::child::terminate(&mut self.child, Duration::from_secs(60));
    }
}

/// `kvloop ARGS` on a node of `hold.json` (its `enter` prefix, as the
/// printed commands; bounded to 60 s by `timeout`); its output is echoed to
/// the test's stderr.
///
/// # Panics
/// When `timeout` or the prefix cannot run.
pub fn tool_on(node: &Value, args: &[&str]) -> Output {
    let enter: Vec<&str> = node["enter"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let o = Command::new("timeout")
        .arg("60")
        .args(&enter)
        .arg(bin("kvloop"))
        .args(args)
        .output()
        .expect("running kvloop");
    eprintln!(
        "$ {} kvloop {}\n{}{}",
        enter.join(" "),
        args.join(" "),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// The stdout of `o` as one JSON value.
///
/// # Panics
/// When it is not JSON.
pub fn json_of(o: &Output) -> Value {
    let s = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(s.trim()).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {s}\n{}",
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

/// The check `name` of a `kvloop doctor --json` report.
///
/// # Panics
/// When there is none.
pub fn doctor_check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {report}"))
}

/// The `summary` lines of `kvloop ping --json`.
pub fn ping_summaries(o: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "summary")
        .collect()
}

/// True while network namespace `ns` exists.
pub fn netns_exists(ns: &str) -> bool {
    Path::new("/run/netns").join(ns).exists()
}
