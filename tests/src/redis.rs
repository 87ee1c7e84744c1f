//! A real `redis-server` (Debian package `redis-server`, installed by
//! scripts/bootstrap.sh) for tests, benches and demos: on 127.0.0.1, a free
//! port, its own temporary directory, no persistence; ready once it answers
//! `PING`; SIGKILLed by its PID on drop (and by the kernel if this process
//! dies first). [`RedisServer::kill`] and [`RedisServer::restart`] make an
//! outage.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A `redis-server` child (see the module docs).
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    log: Option<PathBuf>,
    wrap: Box<dyn Fn(&Path) -> Command + Send>,
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// `redis-server` on `PATH`, else in `/usr/bin` or `/usr/sbin`.
pub fn redis_bin() -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("redis-server"))
        .chain([
            "/usr/bin/redis-server".into(),
            "/usr/sbin/redis-server".into(),
        ])
        .find(|p| p.is_file())
}

impl RedisServer {
    /// Starts one in this process's network namespace.
    ///
    /// # Errors
    /// `redis-server` missing, or not answering `PING` within 10 s.
    pub fn start() -> Result<Self> {
        Self::start_with(None, |bin: &Path| Command::new(bin))
    }

    /// Starts one with `wrap(redis-server path)` as the command (e.g. `ip
    /// netns exec <ns> redis-server`; readiness is checked on 127.0.0.1 of
    /// the caller's namespace), its stdout to `log` when given.
    ///
    /// # Errors
    /// As [`RedisServer::start`].
    pub fn start_with(
        log: Option<&Path>,
        wrap: impl Fn(&Path) -> Command + Send + 'static,
    ) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "kvloop-redis-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut r = Self {
            child: None,
            port: crate::free_port("127.0.0.1"),
            dir,
            log: log.map(Path::to_path_buf),
            wrap: Box::new(wrap),
        };
        r.restart()?;
        Ok(r)
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its temporary directory (removed on drop; room for the caller's files).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// (Re)starts it on the same port; waits until it answers `PING` (≤ 10 s).
    ///
    /// # Errors
    /// As [`RedisServer::start`], or when it is running.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("redis-server is running");
        }
        let bin = redis_bin().context(
            "redis-server not found: install the Debian package redis-server (scripts/bootstrap.sh)",
        )?;
        let out = match &self.log {
            Some(l) => Stdio::from(
                std::fs::File::create(l).with_context(|| format!("creating {}", l.display()))?,
            ),
            None => Stdio::null(),
        };
        let mut c = (self.wrap)(&bin);
        c.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(out);
        // SAFETY: prctl in the child before exec; async-signal-safe.
        unsafe {
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(c.spawn().context("starting redis-server")?);
        let t0 = Instant::now();
        while !self.answers_ping() {
            if t0.elapsed() > Duration::from_secs(10) {
                self.kill();
                bail!("redis-server did not answer PING on port {}", self.port);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn answers_ping(&self) -> bool {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut line = String::new();
        s.write_all(b"PING\r\n").is_ok()
            && BufReader::new(&s).read_line(&mut line).is_ok()
            && line.starts_with("+PONG")
    }

    /// SIGKILL by PID and reap (an outage; [`RedisServer::restart`] ends it).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
