//! Several "nodes" on one machine: network namespaces `kvl<tag>n<i>`, each
//! joined by a veth to one bridge in a switch namespace `kvl<tag>sw`, with
//! addresses in a private /24 that only exists inside them (a rack behind a
//! top-of-rack switch). Per-path shaping: [`NodeStar::limit_path`] slows one
//! node's egress towards one address (`tc prio` + `u32` filter + `tbf`), so
//! one (D → P) path can be slow while the others stay fast. Per-node
//! `/etc/hosts` ([`NodeStar::set_hosts`]): `ip netns exec` bind-mounts
//! `/etc/netns/<ns>/hosts`, so a name can resolve to several addresses as a
//! Kubernetes headless Service does. Made with `ip` and `tc` (iproute2);
//! everything is removed on drop. Needs root (CAP_NET_ADMIN).
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::netns::run;

/// One node of a [`NodeStar`].
#[derive(Debug, Clone)]
pub struct StarNode {
    /// The caller's name for it (`p0`, `d1`, `router`).
    pub name: String,
    /// Its namespace.
    pub ns: String,
    /// Its first address.
    pub addr: Ipv4Addr,
    /// Its veth device (inside `ns`).
    pub dev: String,
}

/// Nodes on one bridge (see the module docs).
pub struct NodeStar {
    /// The switch namespace (holds the bridge).
    pub switch_ns: String,
    /// The nodes, in the order given to [`NodeStar::create`].
    pub nodes: Vec<StarNode>,
    net: (u8, u8),
    extra: std::sync::Mutex<u8>,
}

impl NodeStar {
    /// Creates the switch namespace with a bridge and one namespace per
    /// name, each with address `10.<x>.<y>.<10 + i>/24` (`x`, `y` from
    /// `tag`) on a veth to the bridge, loopback up.
    ///
    /// # Errors
    /// When not root, with more than 100 nodes, or when iproute2 fails (the
    /// message names the command).
    pub fn create(tag: u32, names: &[&str]) -> Result<Self> {
        if !crate::deps::is_root() {
            bail!("network namespaces need root (CAP_NET_ADMIN)");
        }
        if names.len() > 100 {
            bail!("at most 100 nodes, got {}", names.len());
        }
        let net = (150 + ((tag / 250) % 50) as u8, (tag % 250) as u8);
        let switch_ns = format!("kvl{tag}sw");
        let nodes: Vec<StarNode> = names
            .iter()
            .enumerate()
            .map(|(i, n)| StarNode {
                name: n.to_string(),
                ns: format!("kvl{tag}n{i}"),
                addr: Ipv4Addr::new(10, net.0, net.1, 10 + i as u8),
                dev: format!("kn{tag}x{i}"),
            })
            .collect();
        let star = Self {
            switch_ns,
            nodes,
            net,
            extra: std::sync::Mutex::new(0),
        };
        // Leftovers of an earlier run with the same tag.
        star.remove();
        run("ip", &["netns", "add", &star.switch_ns])?;
        let sw = star.switch_ns.as_str();
        run("ip", &["-n", sw, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", sw, "link", "set", "br0", "up"])?;
        for (i, n) in star.nodes.iter().enumerate() {
            let port = format!("ks{tag}x{i}");
            run("ip", &["netns", "add", &n.ns])?;
            run(
                "ip",
                &["link", "add", &n.dev, "type", "veth", "peer", "name", &port],
            )?;
            run("ip", &["link", "set", &n.dev, "netns", &n.ns])?;
            run("ip", &["link", "set", &port, "netns", sw])?;
            run("ip", &["-n", sw, "link", "set", &port, "master", "br0"])?;
            run("ip", &["-n", sw, "link", "set", &port, "up"])?;
            let cidr = format!("{}/24", n.addr);
            run("ip", &["-n", &n.ns, "addr", "add", &cidr, "dev", &n.dev])?;
            run("ip", &["-n", &n.ns, "link", "set", &n.dev, "up"])?;
            run("ip", &["-n", &n.ns, "link", "set", "lo", "up"])?;
        }
        Ok(star)
    }

    /// The node named `name`.
    ///
    /// # Panics
    /// When there is none (a caller's bug).
    pub fn node(&self, name: &str) -> &StarNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node named {name}"))
    }

    /// Adds one more address to node `name` (from `.200` up) and returns it.
    ///
    /// # Errors
    /// When iproute2 fails or 50 extra addresses are in use.
    pub fn add_addr(&self, name: &str) -> Result<Ipv4Addr> {
        let mut k = self.extra.lock().expect("not poisoned");
        if *k >= 50 {
            bail!("at most 50 extra addresses");
        }
        let a = Ipv4Addr::new(10, self.net.0, self.net.1, 200 + *k);
        *k += 1;
        let n = self.node(name);
        run(
            "ip",
            &[
                "-n",
                &n.ns,
                "addr",
                "add",
                &format!("{a}/24"),
                "dev",
                &n.dev,
            ],
        )?;
        Ok(a)
    }

    /// `ip netns exec <ns of name> <program>` as a command to spawn.
    pub fn command_in(&self, name: &str, program: &Path) -> Command {
        crate::netns::NodePair::command_in(&self.node(name).ns, program)
    }

    fn hosts_dir(ns: &str) -> PathBuf {
        PathBuf::from("/etc/netns").join(ns)
    }

    /// Writes node `name`'s `/etc/hosts` (seen by processes started with
    /// [`NodeStar::command_in`]): localhost, then `host` → each address.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn set_hosts(&self, name: &str, entries: &[(&str, Ipv4Addr)]) -> Result<()> {
        let dir = Self::hosts_dir(&self.node(name).ns);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut text = String::from("127.0.0.1 localhost\n::1 localhost\n");
        for (host, a) in entries {
            text.push_str(&format!("{a} {host}\n"));
        }
        std::fs::write(dir.join("hosts"), text)
            .with_context(|| format!("writing {}/hosts", dir.display()))
    }

    /// Limits what node `from` sends to `to` to `rate` (tc syntax, e.g.
    /// `200mbit`): an `htb` root qdisc whose class `1:20` (at `rate`) gets
    /// the packets to `to` by a `u32` filter; everything else goes through
    /// class `1:10` at 100 Gbit/s (unshaped on a veth). HTB, TBF and U32
    /// are what this machine's kernel has (no prio, netem). Replaces an
    /// earlier limit of `from`.
    ///
    /// # Errors
    /// When `tc` fails (the message names the command).
    pub fn limit_path(&self, from: &str, to: Ipv4Addr, rate: &str) -> Result<()> {
        let n = self.node(from);
        let (ns, dev) = (n.ns.as_str(), n.dev.as_str());
        let _ = run("tc", &["-n", ns, "qdisc", "del", "dev", dev, "root"]);
        let tc = |args: &[&str]| {
            let mut v = vec!["-n", ns];
            v.extend_from_slice(args);
            run("tc", &v)
        };
        tc(&[
            "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10",
        ])?;
        tc(&[
            "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate",
            "100gbit", "quantum", "200000",
        ])?;
        tc(&[
            "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", rate,
            "ceil", rate, "quantum", "60000",
        ])?;
        tc(&[
            "filter",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "ip",
            "dst",
            &format!("{to}/32"),
            "flowid",
            "1:20",
        ])
    }

    /// Removes node `from`'s limit, if any.
    pub fn unlimit(&self, from: &str) {
        let n = self.node(from);
        let _ = run("tc", &["-n", &n.ns, "qdisc", "del", "dev", &n.dev, "root"]);
    }

    fn remove(&self) {
        for n in &self.nodes {
            let _ = run("ip", &["netns", "del", &n.ns]);
            let _ = std::fs::remove_dir_all(Self::hosts_dir(&n.ns));
        }
        let _ = run("ip", &["netns", "del", &self.switch_ns]);
    }
}

impl Drop for NodeStar {
    fn drop(&mut self) {
        self.remove();
    }
}
