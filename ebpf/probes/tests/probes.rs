//! Real-kernel tests of kvloop's eBPF probes: every program is loaded and
//! attached, and kernel-measured latencies of known work are compared with
//! user-space timing of the same work.
//!
//! Needs root (CAP_BPF + CAP_PERFMON), tracefs and BTF: these tests are
//! `#[ignore]`d (`make test` runs them) and fail when loading fails.
//! The NIXL tests need the NIXL runtime (`scripts/bootstrap.sh nixl`) in
//! `$KVLOOP_NIXL_DIR` (default `~/.cache/kvloop/nixl-cu12-1.5.1`).
//!
//! Tolerances (consistency checks, not speed targets): a READ's kernel-measured
//! latency lies inside the user-space interval that encloses it, so we check
//! `kernel <= user + 50 µs` for every READ and, on the median of
//! `user - kernel`, `<= max(200 µs, 10 % of user)` (USDT sites) or
//! `max(1 ms, 25 %)` (NIXL: its probes are uprobes on ordinary function
//! entries and returns, ~10 µs each on this VM, and the reader polls), with up
//! to 3 attempts. For prefill the kernel interval (first byte received inside
//! `recv` → first byte sent inside `send`) encloses the server's own timing,
//! so per request `kernel - user <= max(2 ms, 10 %)` and
//! `user - kernel <= max(200 µs, 10 %)`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvloop_common::{Direction, XferOp};
use kvloop_probes::{Event, ProbeConfig, Probes, Source, TraceFilter};

const HELPER: &str = env!("CARGO_BIN_EXE_kvloop-probe-helper");

/// Loads the probes.
///
/// # Panics
/// When they cannot be loaded (not root, no BTF, no tracefs), naming `test`.
fn load(test: &str, cfg: ProbeConfig) -> Probes {
    kvloop_tests::require_root(test);
    Probes::load(cfg).unwrap_or_else(|e| {
        panic!("{test}: needs eBPF (root, tracefs, BTF): the probes could not be loaded: {e}")
    })
}

/// The NIXL runtime's library folder and the environment of a process
/// loading it.
fn nixl(test: &str) -> (PathBuf, Vec<(&'static str, String)>) {
    let libs = kvloop_tests::nixl_libs(test);
    let env = kvloop_tests::nixl_env(&libs);
    (libs, env)
}

/// A helper process that waits for "go" on stdin.
struct Helper {
    child: Child,
    lines: mpsc::Receiver<String>,
    pid: u32,
}

impl Helper {
    fn spawn(args: &[&str], env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(HELPER);
        cmd.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn kvloop-probe-helper");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("helper did not get ready in 60 s");
        let pid = first
            .strip_prefix("ready pid=")
            .unwrap_or_else(|| panic!("unexpected helper line {first:?}"))
            .parse()
            .unwrap();
        Self { child, lines, pid }
    }

    /// Sends "go" and collects (id, user_ns) until "done" (bounded: 60 s).
    fn run(&mut self) -> Vec<(u64, u64)> {
        writeln!(self.child.stdin.as_mut().unwrap(), "go").unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self
                .lines
                .recv_timeout(left)
                .expect("helper did not finish in 60 s");
            if l == "done" {
                break;
            }
            let mut id = None;
            let mut ns = None;
            for kv in l.split_whitespace() {
                if let Some(v) = kv.strip_prefix("id=") {
                    id = v.parse().ok();
                }
                if let Some(v) = kv.strip_prefix("user_ns=") {
                    ns = v.parse().ok();
                }
            }
            out.push((id.expect("id"), ns.expect("user_ns")));
        }
        let st = self.child.wait().unwrap();
        assert!(st.success(), "helper exited with {st}");
        out
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn collect_xfers(
    trace: &mut kvloop_probes::TraceStream,
    n: usize,
) -> Vec<kvloop_probes::XferSample> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        if let Some(Event::Xfer(s)) = trace.next_timeout(Duration::from_millis(200)) {
            out.push(s);
        }
    }
    out
}

#[test]
#[ignore = "needs root (eBPF) and the NIXL runtime (scripts/bootstrap.sh nixl)"]
fn loads_and_attaches_every_program() {
    let (libs, _) = nixl("loads_and_attaches_every_program");
    let p = load("loads_and_attaches_every_program", ProbeConfig::default());
    assert_eq!(p.source(), Source::Ebpf);
    p.attach_transfer_sites(HELPER, None)
        .expect("attach USDT sites");
    let syms = p
        .attach_nixl(libs.join("libnixl.so"), None)
        .expect("attach NIXL");
    assert_eq!(syms.len(), 3, "{syms:?}");
    let attached = p.attached();
    for needle in [
        "sock:sock_recv_length",
        "sock:sock_send_length",
        "syscalls:sys_enter_read",
        "syscalls:sys_exit_read",
        "syscalls:sys_enter_recvfrom",
        "syscalls:sys_exit_recvfrom",
        "tcp:tcp_retransmit_skb",
        "kvloop_probe_read_post",
        "kvloop_probe_read_done",
    ] {
        assert!(
            attached.iter().any(|a| a.contains(needle)),
            "{needle} not in {attached:#?}"
        );
    }
    p.detach_all().unwrap();
    assert!(p.attached().is_empty());
}

/// Median over READs of `user - kernel`, ns, skipping the first `skip`.
fn median_gap(pairs: &[(u64, u64)], skip: usize) -> (u64, u64) {
    let rest = &pairs[skip.min(pairs.len() - 1)..];
    let gap = median(rest.iter().map(|(k, u)| u.saturating_sub(*k)).collect());
    let mu = median(rest.iter().map(|p| p.1).collect());
    (gap, mu)
}

/// Runs `measure` up to 3 times until the median gap is within tolerance
/// (other tenants of a 2-core VM can preempt the helper inside a uprobe trap,
/// which user space sees and the kernel timestamps do not).
fn within_tolerance(
    name: &str,
    mut measure: impl FnMut() -> Vec<(u64, u64)>,
    skip: usize,
    floor_ns: u64,
    pct: u64,
) {
    let mut last = (0, 0);
    for attempt in 1..=3 {
        let pairs = measure();
        let (gap, mu) = median_gap(&pairs, skip);
        let tol = (mu * pct / 100).max(floor_ns);
        eprintln!(
            "{name}: attempt {attempt}: median user-kernel gap {gap} ns, median user {mu} ns, tolerance {tol} ns"
        );
        if gap <= tol {
            return;
        }
        last = (gap, tol);
    }
    panic!(
        "{name}: median user-kernel gap {} ns > tolerance {} ns in 3 attempts",
        last.0, last.1
    );
}

#[test]
#[ignore = "needs root (eBPF: CAP_BPF, CAP_PERFMON), tracefs and BTF"]
fn usdt_read_latency_matches_userspace() {
    let p = load(
        "usdt_read_latency_matches_userspace",
        ProbeConfig::default(),
    );
    let peer = "decode-usdt-test";
    let mut total = 0;
    within_tolerance(
        "usdt",
        || {
            let mut h = Helper::spawn(&["usdt-reads", "20", "2000", "65536", peer], &[]);
            p.attach_transfer_sites(HELPER, Some(h.pid))
                .expect("attach");
            let mut trace = p.trace(TraceFilter {
                peer: Some(peer.into()),
                ..Default::default()
            });
            let user = h.run();
            total += user.len() as u64;
            let kernel = collect_xfers(&mut trace, user.len());
            assert_eq!(
                kernel.len(),
                user.len(),
                "kernel saw {} of {} READs",
                kernel.len(),
                user.len()
            );
            let mut pairs = Vec::new();
            for (id, u) in &user {
                let k = kernel
                    .iter()
                    .find(|s| s.id == *id)
                    .unwrap_or_else(|| panic!("READ {id} not seen"));
                assert_eq!(k.bytes, 65536);
                assert_eq!(k.descriptors, 4);
                assert_eq!(k.direction, Direction::PrefillToDecode);
                assert_eq!(k.status, 0);
                assert_eq!(k.site, "kvloop");
                assert_eq!(k.tgid, h.pid);
                assert!(
                    k.latency_ns <= u + 50_000,
                    "READ {id}: kernel {} ns > user {u} ns + 50 µs",
                    k.latency_ns
                );
                assert!(
                    k.latency_ns >= 2_000_000,
                    "READ {id}: kernel {} ns < 2 ms of work",
                    k.latency_ns
                );
                pairs.push((k.latency_ns, *u));
            }
            pairs
        },
        0,
        200_000,
        10,
    );

    // in-kernel histogram: every READ of 64 KiB to this peer, P→D, ≥ 2 ms
    let snap = p.snapshot();
    let (labels, hist) = snap
        .xfer_histograms
        .iter()
        .find(|(l, _)| l.peer == peer)
        .expect("histogram for the peer");
    assert_eq!(hist.count, total);
    assert_eq!(labels.size_class, Some(16));
    assert_eq!(labels.direction, Direction::PrefillToDecode);
    assert!(labels.ok);
    assert!(hist.quantile_upper_ns(0.5).unwrap() >= 2_000_000);

    // Prometheus exposition
    let mut reg = prometheus_client::registry::Registry::default();
    p.register_metrics(&mut reg);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("vllm:nixl_xfer_time_seconds_count")
                && l.contains(peer)
                && l.contains("source=\"ebpf\"")
                && l.ends_with(&format!(" {total}"))),
        "{text}"
    );
    assert!(
        text.contains("kvloop_probe_source_info{source=\"ebpf\"} 1"),
        "{text}"
    );
}

#[test]
#[ignore = "needs root (eBPF) and the NIXL runtime (scripts/bootstrap.sh nixl)"]
fn nixl_read_probed_at_library() {
    let (libs, env) = nixl("nixl_read_probed_at_library");
    let p = load("nixl_read_probed_at_library", ProbeConfig::default());
    let mut total = 0;
    within_tolerance(
        "nixl",
        || {
            let mut h = Helper::spawn(&["nixl-read", "20", "1048576"], &env);
            p.attach_nixl(libs.join("libnixl.so"), Some(h.pid))
                .expect("attach NIXL");
            let mut trace = p.trace(TraceFilter {
                peer: Some("kvloop-target".into()),
                ..Default::default()
            });
            let user = h.run();
            total += user.len() as u64;
            let kernel = collect_xfers(&mut trace, user.len());
            assert_eq!(
                kernel.len(),
                user.len(),
                "kernel saw {} of {} NIXL READs",
                kernel.len(),
                user.len()
            );
            for k in &kernel {
                assert_eq!(k.site, "nixl");
                assert_eq!(k.status, 0);
                assert_eq!(k.tgid, h.pid);
                // read from the request handle at the post: one 1 MiB
                // descriptor READ from agent "kvloop-target"
                assert_eq!(k.op, XferOp::Read, "{k:?}");
                assert_eq!(k.bytes, 1_048_576, "{k:?}");
                assert_eq!(k.descriptors, 1, "{k:?}");
                assert_eq!(k.peer, "kvloop-target", "{k:?}");
                assert!(Event::Xfer(k.clone()).line().contains("dir=read"), "{k:?}");
            }
            // one READ at a time: events arrive in READ order
            let mut pairs = Vec::new();
            for ((_, u), k) in user.iter().zip(&kernel) {
                assert!(
                    k.latency_ns <= u + 50_000,
                    "kernel {} ns > user {u} ns + 50 µs",
                    k.latency_ns
                );
                pairs.push((k.latency_ns, *u));
            }
            pairs
        },
        1, // the first READ sets up the UCX connection
        1_000_000,
        25,
    );
    let snap = p.snapshot();
    assert!(
        snap.xfer_histograms.iter().any(|(l, h)| l.site == "nixl"
            && l.peer == "kvloop-target"
            && h.count == total
            && h.sum_bytes == total * 1_048_576
            && l.size_class == Some(20)),
        "{:?}",
        snap.xfer_histograms
    );
}

/// Transfers made as vLLM's NIXL connector makes them (prepared descriptor
/// lists, `makeXferReq`), WRITE and READ in turn, 3 descriptors of 64 KiB
/// each, not contiguous (NIXL merges contiguous ones): the library probes report the operation, bytes, descriptor count
/// and remote agent of every one, read from the request handle at the post.
#[test]
#[ignore = "needs root (eBPF) and the NIXL runtime (scripts/bootstrap.sh nixl)"]
fn nixl_prepped_transfers_report_op_bytes_descs_and_peer() {
    let test = "nixl_prepped_transfers_report_op_bytes_descs_and_peer";
    let (libs, env) = nixl(test);
    let p = load(test, ProbeConfig::default());
    let mut h = Helper::spawn(&["nixl-prepped", "6", "3", "65536"], &env);
    p.attach_nixl(libs.join("libnixl.so"), Some(h.pid))
        .expect("attach NIXL");
    let mut trace = p.trace(TraceFilter::default());
    let user = h.run();
    assert_eq!(user.len(), 6);
    let kernel: Vec<_> = collect_xfers(&mut trace, user.len())
        .into_iter()
        .filter(|s| s.tgid == h.pid)
        .collect();
    assert_eq!(kernel.len(), user.len(), "{kernel:#?}");
    // one transfer at a time: events arrive in transfer order
    for (i, k) in kernel.iter().enumerate() {
        let want = if i % 2 == 0 {
            XferOp::Write
        } else {
            XferOp::Read
        };
        assert_eq!(k.site, "nixl", "{k:?}");
        assert_eq!(k.status, 0, "{k:?}");
        assert_eq!(k.op, want, "transfer {i}: {k:?}");
        assert_eq!(k.bytes, 3 * 65536, "transfer {i}: {k:?}");
        assert_eq!(k.descriptors, 3, "transfer {i}: {k:?}");
        assert_eq!(k.peer, "kvloop-target", "transfer {i}: {k:?}");
        let line = Event::Xfer(k.clone()).line();
        assert!(
            line.contains(&format!("dir={}", want.label())) && line.contains("descs=3"),
            "{line}"
        );
    }
}

/// Server on loopback answering each request after `delay`; returns the
/// server-side (user) time from the request's first byte to the response.
fn serve(listener: TcpListener, delay: Duration, requests: usize, tx: mpsc::Sender<u64>) {
    listener.set_nonblocking(false).unwrap();
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for _ in 0..requests {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let mut t0 = None;
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "client closed early");
            t0.get_or_insert_with(Instant::now);
            buf.extend_from_slice(&chunk[..n]);
        }
        std::thread::sleep(delay);
        let body = b"{\"ok\":true}";
        let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
        let t1 = t0.unwrap().elapsed();
        s.write_all(resp.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        tx.send(t1.as_nanos() as u64).unwrap();
    }
}

#[test]
#[ignore = "needs root (eBPF: CAP_BPF, CAP_PERFMON), tracefs and BTF"]
fn prefill_latency_and_token_attribution() {
    let p = load(
        "prefill_latency_and_token_attribution",
        ProbeConfig::default(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    p.prefill_port(port).unwrap();
    let mut trace = p.trace(TraceFilter::default());
    let (tx, rx) = mpsc::channel();
    let delay = Duration::from_millis(20);
    let server = std::thread::spawn(move || serve(listener, delay, 3, tx));
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let reqs = [
        Some("prompt=1200,reused=1024"),
        Some("prompt=300,reused=0"),
        None, // unattributed, still timed
    ];
    for hdr in reqs {
        let mut r =
            String::from("POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 2\r\n");
        if let Some(h) = hdr {
            r.push_str(&format!("X-KVLoop-Tokens: {h}\r\n"));
        }
        r.push_str("\r\n{}");
        c.write_all(r.as_bytes()).unwrap();
        // read the whole response (keep-alive: the next request reuses the socket)
        let mut got = Vec::new();
        let mut chunk = [0u8; 1024];
        while !(got.windows(4).any(|w| w == b"\r\n\r\n") && got.ends_with(b"}")) {
            let n = c.read(&mut chunk).unwrap();
            assert!(n > 0);
            got.extend_from_slice(&chunk[..n]);
        }
    }
    server.join().unwrap();
    let user: Vec<u64> = rx.try_iter().collect();
    assert_eq!(user.len(), 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut samples = Vec::new();
    while samples.len() < 3 && Instant::now() < deadline {
        if let Some(Event::Prefill(s)) = trace.next_timeout(Duration::from_millis(200))
            && s.port == port
        {
            samples.push(s);
        }
    }
    assert_eq!(samples.len(), 3, "{samples:#?}");
    for (s, u) in samples.iter().zip(&user) {
        eprintln!(
            "prefill: kernel {} ns, user {u} ns, tokens {:?}",
            s.latency_ns, s.tokens
        );
        assert!(s.latency_ns >= delay.as_nanos() as u64, "{s:?}");
        // the kernel interval (inside recv → inside send) encloses the
        // server's user-space interval (after recv → before send)
        assert!(
            s.latency_ns <= u + (u / 10).max(2_000_000),
            "kernel {} vs user {u}",
            s.latency_ns
        );
        assert!(
            u.saturating_sub(s.latency_ns) <= (u / 10).max(200_000),
            "kernel {} vs user {u}",
            s.latency_ns
        );
        assert_eq!(s.source, Source::Ebpf);
        assert!(s.peer.is_some_and(|a| a.ip().is_loopback()), "{:?}", s.peer);
    }
    let t0 = samples[0]
        .tokens
        .as_ref()
        .expect("first request attributed");
    assert_eq!((t0.prompt_tokens, t0.reused_tokens), (1200, 1024));
    let t1 = samples[1]
        .tokens
        .as_ref()
        .expect("second request attributed");
    assert_eq!((t1.prompt_tokens, t1.reused_tokens), (300, 0));
    assert_eq!(
        samples[2].tokens,
        Err(kvloop_probes::Unattributed::NoHeader)
    );
    let snap = p.snapshot();
    let (_, h) = snap
        .prefill_histograms
        .iter()
        .find(|(pt, _)| *pt == port)
        .expect("prefill histogram");
    assert_eq!(h.count, 3);
}

/// A process that READs through kvloop's dataplane with its NIXL backend,
/// probed at the NIXL library (as an engine using NIXL directly would be) and
/// at the dataplane's USDT sites: every READ is seen once by each.
#[cfg(feature = "dataplane")]
#[test]
#[ignore = "needs root (eBPF) and the NIXL runtime (scripts/bootstrap.sh nixl)"]
fn dataplane_nixl_reads_seen_at_library_and_sites() {
    let (libs, env) = nixl("dataplane_nixl_reads_seen_at_library_and_sites");
    let p = load(
        "dataplane_nixl_reads_seen_at_library_and_sites",
        ProbeConfig::default(),
    );
    let mut h = Helper::spawn(&["dataplane-reads", "nixl", "10", "65536"], &env);
    p.attach_nixl(libs.join("libnixl.so"), Some(h.pid))
        .expect("attach NIXL");
    p.attach_transfer_sites(HELPER, Some(h.pid))
        .expect("attach sites");
    let mut trace = p.trace(TraceFilter::default());
    let user = h.run();
    assert_eq!(user.len(), 10);
    let events: Vec<_> = collect_xfers(&mut trace, 2 * user.len())
        .into_iter()
        .filter(|s| s.tgid == h.pid)
        .collect();
    let nixl: Vec<_> = events.iter().filter(|s| s.site == "nixl").collect();
    let sites: Vec<_> = events.iter().filter(|s| s.site == "kvloop").collect();
    assert_eq!(nixl.len(), user.len(), "NIXL library events: {events:#?}");
    assert_eq!(
        sites.len(),
        user.len(),
        "dataplane site events: {events:#?}"
    );
    for s in &sites {
        assert_eq!(s.peer, "decode-0");
        assert_eq!(s.direction, Direction::DecodeToPrefill);
        assert_eq!(s.bytes, 65536);
        assert_eq!(s.status, 0);
        let (_, u) = user.iter().find(|(id, _)| *id == s.id).expect("READ id");
        assert!(
            s.latency_ns <= u + 50_000,
            "site {} ns > user {u} ns",
            s.latency_ns
        );
    }
    for s in &nixl {
        assert_eq!(s.status, 0);
        assert!(
            !s.peer.is_empty(),
            "NIXL remote agent name captured at createXferReq"
        );
        // from the request handle: a READ with its descriptors and bytes
        assert_eq!(s.op, XferOp::Read, "{s:?}");
        assert!(s.bytes > 0 && s.descriptors > 0, "{s:?}");
        // the dataplane names its NIXL agent `<engine id>-<pid>`
        assert!(s.peer.starts_with("decode-0"), "{s:?}");
    }
    let sum = |v: &[&kvloop_probes::XferSample]| {
        (
            v.iter().map(|s| s.bytes).sum::<u64>(),
            v.iter().map(|s| u64::from(s.descriptors)).sum::<u64>(),
        )
    };
    let (nixl_bytes, nixl_descs) = sum(&nixl);
    let (site_bytes, site_descs) = sum(&sites);
    assert_eq!(
        nixl_bytes, site_bytes,
        "bytes at the NIXL library and at the dataplane's sites"
    );
    assert_eq!(
        nixl_descs, site_descs,
        "descriptors at the NIXL library and at the dataplane's sites"
    );
}

/// A network namespace with one end of a veth pair; removed on drop.
struct Netns {
    name: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// SYNs to an address behind a veth whose other end (in a namespace this
/// test creates) has no such address: nothing answers, TCP retransmits the
/// SYN after its 1 s initial RTO, and the probe counts it for that peer.
#[test]
#[ignore = "needs root (eBPF, network namespaces)"]
fn tcp_retransmits_counted_per_peer() {
    let p = load("tcp_retransmits_counted_per_peer", ProbeConfig::default());
    let id = std::process::id() % 100_000;
    let ns = Netns {
        name: format!("kvloop-rt-{id}"),
    };
    let (host_if, ns_if) = (format!("kvrh{id}"), format!("kvrn{id}"));
    let net = 100 + (id % 150);
    let setup = || -> Result<(), String> {
        ip(&["netns", "add", &ns.name])?;
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
        ])?;
        ip(&["link", "set", &ns_if, "netns", &ns.name])?;
        ip(&["addr", "add", &format!("10.78.{net}.1/24"), "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        ip(&["-n", &ns.name, "link", "set", &ns_if, "up"])?;
        Ok(())
    };
    if let Err(e) = setup() {
        panic!("tcp_retransmits_counted_per_peer: needs a network namespace and a veth: {e}");
    }
    let peer: std::net::SocketAddr = format!("10.78.{net}.2:5555").parse().unwrap();
    let mut trace = p.trace(TraceFilter {
        peer: Some(peer.to_string()),
        ..Default::default()
    });
    // bounded: one connect attempt of 2.5 s (SYN at 0 s, retransmit at ~1 s, ~3 s)
    let r = TcpStream::connect_timeout(&peer, Duration::from_millis(2500));
    assert!(r.is_err(), "nothing should answer at {peer}");
    let ev = trace.next_timeout(Duration::from_secs(2));
    assert!(
        matches!(ev, Some(Event::Retransmit { peer: a, .. }) if a == peer),
        "no retransmit event for {peer}: {ev:?}"
    );
    let snap = p.snapshot();
    let c = snap
        .retransmits
        .iter()
        .find(|r| r.peer == peer)
        .expect("retransmit counter for the peer");
    assert!(c.count >= 1, "{c:?}");
}
