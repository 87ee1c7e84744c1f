//! Two network namespaces joined by a veth pair, for in-process tests: a
//! thread enters one with [`enter`] and everything it starts afterwards
//! (sockets, the backend's threads) lives there. Made with `ip` (iproute2),
//! removed on drop. Needs root (CAP_NET_ADMIN).
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::Command;

/// Namespaces `kvdp<tag>a` (address `10.<x>.<y>.1`) and `kvdp<tag>b` (`.2`).
pub struct NsPair {
    /// Namespace of node A.
    pub ns_a: String,
    /// Namespace of node B.
    pub ns_b: String,
    /// Address of node A, inside `ns_a`.
    pub addr_a: Ipv4Addr,
    /// Address of node B, inside `ns_b`.
    pub addr_b: Ipv4Addr,
    dev_b: String,
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running `{program}` (install iproute2): {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Panics unless running as root: the namespace tests need it.
pub fn require_root(test: &str) {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "{test}: needs root (network namespaces, tc); run as root"
    );
}

impl NsPair {
    /// Creates the pair for `tag` (0..10000), removing leftovers of an
    /// earlier run with the same tag.
    ///
    /// # Panics
    /// When `ip` fails (not root, iproute2 missing).
    pub fn create(tag: u32) -> Self {
        let tag = tag % 10_000;
        let (x, y) = (150 + (tag / 250) % 40, tag % 250);
        let p = Self {
            ns_a: format!("kvdp{tag}a"),
            ns_b: format!("kvdp{tag}b"),
            addr_a: Ipv4Addr::new(10, x as u8, y as u8, 1),
            addr_b: Ipv4Addr::new(10, x as u8, y as u8, 2),
            dev_b: format!("kvdpb{tag}"),
        };
        let dev_a = format!("kvdpa{tag}");
        for ns in [&p.ns_a, &p.ns_b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        run("ip", &["netns", "add", &p.ns_a]);
        run("ip", &["netns", "add", &p.ns_b]);
        run(
            "ip",
            &[
                "link", "add", &dev_a, "type", "veth", "peer", "name", &p.dev_b,
            ],
        );
        run("ip", &["link", "set", &dev_a, "netns", &p.ns_a]);
        run("ip", &["link", "set", &p.dev_b, "netns", &p.ns_b]);
        for (ns, dev, addr) in [(&p.ns_a, &dev_a, p.addr_a), (&p.ns_b, &p.dev_b, p.addr_b)] {
            run(
                "ip",
                &["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev],
            );
            run("ip", &["-n", ns, "link", "set", dev, "up"]);
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        p
    }

    /// Limits B's egress (what A READs from B) to `rate` with `tc tbf`.
    pub fn limit_rate_b(&self, rate: &str) {
        run(
            "tc",
            &[
                "-n",
                &self.ns_b,
                "qdisc",
                "replace",
                "dev",
                &self.dev_b,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "100ms",
            ],
        );
    }
}

impl Drop for NsPair {
    fn drop(&mut self) {
        for ns in [&self.ns_a, &self.ns_b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// Moves the calling thread into namespace `ns` (threads it starts later
/// inherit it).
///
/// # Panics
/// When the namespace does not exist or `setns` fails.
pub fn enter(ns: &str) {
    let f = std::fs::File::open(format!("/var/run/netns/{ns}"))
        .unwrap_or_else(|e| panic!("open namespace {ns}: {e}"));
    // SAFETY: `f` is an open namespace file descriptor for the whole call;
    // setns only changes the calling thread's network namespace.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns({ns}): {}", std::io::Error::last_os_error());
}
