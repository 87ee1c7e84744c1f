//! Two "nodes" on one machine: a pair of network namespaces joined by a veth
//! pair, with addresses in a private /24 that only exists inside them. Made
//! with `ip` (iproute2); removed on drop. Needs root (CAP_NET_ADMIN).
use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// A pair of namespaces `a` and `b` joined by a veth; `a` has `addr_a`, `b` `addr_b`.
pub struct NodePair {
    /// Namespace of node A.
    pub ns_a: String,
    /// Namespace of node B.
    pub ns_b: String,
    /// Address of node A (inside `ns_a`).
    pub addr_a: Ipv4Addr,
    /// Address of node B (inside `ns_b`).
    pub addr_b: Ipv4Addr,
    /// veth device inside `ns_a`.
    pub dev_a: String,
    /// veth device inside `ns_b`.
    pub dev_b: String,
}

fn ip(args: &[&str]) -> Result<()> {
    run("ip", args)
}

/// Runs `program args` (iproute2's `ip` or `tc`); an error names the
/// command and its stderr.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running `{program}` (install iproute2)"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl NodePair {
    /// Creates namespaces `kvl<tag>a` / `kvl<tag>b` with a veth pair and
    /// addresses `10.<x>.<y>.1/24` / `.2/24` derived from `tag`, loopback up.
    ///
    /// # Errors
    /// When not root or iproute2 fails (the message names the command).
    pub fn create(tag: u32) -> Result<Self> {
        if !crate::deps::is_root() {
            bail!("network namespaces need root (CAP_NET_ADMIN)");
        }
        let ns_a = format!("kvl{tag}a");
        let ns_b = format!("kvl{tag}b");
        let (x, y) = (200 + (tag / 250) % 50, tag % 250);
        let addr_a = Ipv4Addr::new(10, x as u8, y as u8, 1);
        let addr_b = Ipv4Addr::new(10, x as u8, y as u8, 2);
        let dev_a = format!("kva{tag}");
        let dev_b = format!("kvb{tag}");
        // Leftovers of an earlier run with the same tag.
        let _ = ip(&["netns", "del", &ns_a]);
        let _ = ip(&["netns", "del", &ns_b]);
        let pair = Self {
            ns_a,
            ns_b,
            addr_a,
            addr_b,
            dev_a,
            dev_b,
        };
        ip(&["netns", "add", &pair.ns_a])?;
        ip(&["netns", "add", &pair.ns_b])?;
        ip(&[
            "link",
            "add",
            &pair.dev_a,
            "type",
            "veth",
            "peer",
            "name",
            &pair.dev_b,
        ])?;
        ip(&["link", "set", &pair.dev_a, "netns", &pair.ns_a])?;
        ip(&["link", "set", &pair.dev_b, "netns", &pair.ns_b])?;
        for (ns, dev, addr) in [
            (&pair.ns_a, &pair.dev_a, addr_a),
            (&pair.ns_b, &pair.dev_b, addr_b),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }

    /// `ip netns exec <ns> <program>` as a command to spawn (add its arguments).
    pub fn command_in(ns: &str, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(program);
        c
    }

    /// Moves the calling thread into namespace `ns` (threads it starts later
    /// inherit it): for in-process tests whose sockets and backend threads
    /// must live on one node.
    ///
    /// # Panics
    /// When the namespace does not exist or `setns` fails.
    pub fn join(ns: &str) {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(format!("/run/netns/{ns}"))
            .unwrap_or_else(|e| panic!("open namespace {ns}: {e}"));
        // SAFETY: `f` is an open namespace file descriptor for the whole
        // call; setns only changes the calling thread's network namespace.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns({ns}): {}", std::io::Error::last_os_error());
    }

    /// Joins A and B by one more veth pair (a second NIC, e.g. a rail),
    /// number `k` (1 to 200), with addresses `172.16.<k>.1/24` (in A) and
    /// `.2/24` (in B): its own subnet, so traffic between those addresses
    /// takes this link. Returns (address in A, address in B, device in B);
    /// removed with the namespaces.
    ///
    /// # Errors
    /// When `k` is out of range or iproute2 fails (the message names the
    /// command).
    pub fn add_link(&self, k: u32) -> Result<(Ipv4Addr, Ipv4Addr, String)> {
        if !(1..=200).contains(&k) {
            bail!("extra link number {k}: expected 1 to 200");
        }
        let dev_a = format!("{}r{k}", self.dev_a);
        let dev_b = format!("{}r{k}", self.dev_b);
        let addr_a = Ipv4Addr::new(172, 16, k as u8, 1);
        let addr_b = Ipv4Addr::new(172, 16, k as u8, 2);
        ip(&[
            "link", "add", &dev_a, "type", "veth", "peer", "name", &dev_b,
        ])?;
        ip(&["link", "set", &dev_a, "netns", &self.ns_a])?;
        ip(&["link", "set", &dev_b, "netns", &self.ns_b])?;
        for (ns, dev, addr) in [(&self.ns_a, &dev_a, addr_a), (&self.ns_b, &dev_b, addr_b)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok((addr_a, addr_b, dev_b))
    }

    /// Limits the rate of B's egress (what A READs from B) with `tc tbf`.
    ///
    /// # Errors
    /// When `tc` fails.
    pub fn limit_rate_b(&self, rate: &str) -> Result<()> {
        self.limit_rate_dev_b(&self.dev_b, rate)
    }

    /// Limits the rate of B's egress on its device `dev` (the first veth,
    /// or one from [`NodePair::add_link`]) with `tc tbf`.
    ///
    /// # Errors
    /// When `tc` fails.
    pub fn limit_rate_dev_b(&self, dev: &str, rate: &str) -> Result<()> {
        let out = Command::new("tc")
            .args([
                "-n", &self.ns_b, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
            ])
            .args(["burst", "256kb", "latency", "100ms"])
            .output()
            .context("running `tc`")?;
        if !out.status.success() {
            bail!(
                "tc tbf {rate}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl Drop for NodePair {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.ns_a]);
        let _ = ip(&["netns", "del", &self.ns_b]);
    }
}
