//! Network state: link state, MTU and counters by rtnetlink
//! (`netlink-packet-route`), link speed from sysfs
//! (`/sys/class/net/<if>/speed`), EFA/RDMA port counters from
//! `/sys/class/infiniband` where present. A link event (`RTMGRP_LINK`
//! multicast) arrives at once; a full dump runs every `network.poll_ms`.
//! The watch only reports ([`watch`] sends [`NetEvent`]s on a channel); the
//! agent applies them (`Agent::apply_links`): a link going down invalidates
//! every peer path over it at once (the cost model publishes "recompute"
//! for the pairs over it and a push goes out).
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkMessage, State};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use tokio::sync::mpsc;

/// `RTMGRP_LINK` multicast group bit (linux/rtnetlink.h).
const RTMGRP_LINK: u32 = 1;

/// One link as rtnetlink reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkState {
    /// Interface index.
    pub index: u32,
    /// Name.
    pub name: String,
    /// Administratively and operationally up (carrier).
    pub up: bool,
    /// MTU, bytes.
    pub mtu: u32,
    /// Counters (0 when absent).
    pub rx_bytes: u64,
    /// Transmitted bytes.
    pub tx_bytes: u64,
    /// Receive errors.
    pub rx_errors: u64,
    /// Transmit errors.
    pub tx_errors: u64,
    /// Speed from sysfs, Mbit/s (`None` when unknown or not read yet).
    pub speed_mbps: Option<u64>,
}

/// Parses a link message. `None` without a name.
pub fn parse_link(m: &LinkMessage) -> Option<LinkState> {
    let mut s = LinkState {
        index: m.header.index,
        ..Default::default()
    };
    let mut oper = State::Unknown;
    for a in &m.attributes {
        match a {
            LinkAttribute::IfName(n) => s.name = n.clone(),
            LinkAttribute::Mtu(v) => s.mtu = *v,
            LinkAttribute::OperState(o) => oper = *o,
            LinkAttribute::Stats64(st) => {
                s.rx_bytes = st.rx_bytes;
                s.tx_bytes = st.tx_bytes;
                s.rx_errors = st.rx_errors;
                s.tx_errors = st.tx_errors;
            }
            _ => {}
        }
    }
    let admin_up = m.header.flags.contains(LinkFlags::Up);
    let lower_up = m.header.flags.contains(LinkFlags::LowerUp);
    // loopback and some virtual links report operstate UNKNOWN while working.
    s.up = admin_up && (oper == State::Up || (oper == State::Unknown && lower_up));
    (!s.name.is_empty()).then_some(s)
}

/// Peers whose path turned invalid (`up` → down, or first seen down) and
/// those that came back, given the previous and new state of each link and
/// the peer → interface map. Pure.
pub fn path_changes(
    prev_up: &HashMap<String, bool>,
    links: &[LinkState],
    peer_ifaces: &HashMap<String, String>,
) -> (Vec<(String, String)>, Vec<String>) {
    let mut down = Vec::new();
    let mut up = Vec::new();
    for l in links {
        let was = prev_up.get(&l.name).copied();
        for (peer, iface) in peer_ifaces {
            if iface != &l.name {
                continue;
            }
            match (was, l.up) {
                (Some(true) | None, false) => down.push((peer.clone(), l.name.clone())),
                (Some(false), true) => up.push(peer.clone()),
                _ => {}
            }
        }
    }
    down.sort();
    up.sort();
    (down, up)
}

/// The local interface whose IPv4/IPv6 subnet contains `peer`: `(ifindex,
/// prefix_len, local address)` triples from an address dump. Pure.
pub fn iface_for(peer: IpAddr, addrs: &[(u32, u8, IpAddr)]) -> Option<u32> {
    addrs
        .iter()
        .filter(|(_, plen, a)| same_subnet(*a, peer, *plen))
        .max_by_key(|(_, plen, _)| *plen)
        .map(|(i, _, _)| *i)
}

fn same_subnet(a: IpAddr, b: IpAddr, plen: u8) -> bool {
    match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            let m = if plen == 0 {
                0
            } else {
                u32::MAX << (32 - plen.min(32) as u32)
            };
            u32::from(a) & m == u32::from(b) & m
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => {
            let m = if plen == 0 {
                0
            } else {
                u128::MAX << (128 - plen.min(128) as u32)
            };
            u128::from(a) & m == u128::from(b) & m
        }
        _ => false,
    }
}

fn dump(req: RouteNetlinkMessage) -> std::io::Result<Vec<RouteNetlinkMessage>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut hdr = NetlinkHeader::default();
    hdr.flags = NLM_F_REQUEST | NLM_F_DUMP;
    hdr.sequence_number = 1;
    let mut nl = NetlinkMessage::new(hdr, NetlinkPayload::from(req));
    nl.finalize();
    let mut buf = vec![0u8; nl.header.length as usize];
    nl.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let mut out = Vec::new();
    let mut rbuf = vec![0u8; 1 << 16];
    for _ in 0..100_000 {
        rbuf.clear();
        rbuf.resize(1 << 16, 0);
        let n = socket.recv(&mut &mut rbuf[..], 0)?;
        let mut off = 0;
        while off < n {
            let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rbuf[off..n])
                .map_err(|e| std::io::Error::other(format!("netlink: {e}")))?;
            let len = m.header.length as usize;
            match m.payload {
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::Error(e) => {
                    return Err(std::io::Error::other(format!("netlink dump: {e:?}")));
                }
                NetlinkPayload::InnerMessage(x) => out.push(x),
                _ => {}
            }
            if len == 0 {
                break;
            }
            off += len;
        }
    }
    Err(std::io::Error::other("netlink dump did not end"))
}

/// Dumps every link.
///
/// # Errors
/// Netlink socket errors.
pub fn dump_links() -> std::io::Result<Vec<LinkState>> {
    Ok(dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => parse_link(&l),
            _ => None,
        })
        .collect())
}

/// Dumps every address as `(ifindex, prefix_len, address)`.
///
/// # Errors
/// Netlink socket errors.
pub fn dump_addrs() -> std::io::Result<Vec<(u32, u8, IpAddr)>> {
    Ok(
        dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()))?
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) => a.attributes.iter().find_map(|x| match x {
                    AddressAttribute::Local(ip) | AddressAttribute::Address(ip) => {
                        Some((a.header.index, a.header.prefix_len, *ip))
                    }
                    _ => None,
                }),
                _ => None,
            })
            .collect(),
    )
}

/// Link speed from sysfs, Mbit/s (`None` when unknown, e.g. -1 or absent).
pub fn sysfs_speed_mbps(iface: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/speed"))
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .filter(|v| *v > 0)
        .map(|v| v as u64)
}

/// EFA/RDMA port counters: `(device, port, counter, value)` from
/// `<root>/<dev>/ports/<port>/{counters,hw_counters}/*`.
pub fn rdma_counters(root: &Path) -> Vec<(String, String, String, u64)> {
    let mut out = Vec::new();
    let Ok(devs) = std::fs::read_dir(root) else {
        return out;
    };
    for d in devs.flatten() {
        let dev = d.file_name().to_string_lossy().to_string();
        let Ok(ports) = std::fs::read_dir(d.path().join("ports")) else {
            continue;
        };
        for p in ports.flatten() {
            let port = p.file_name().to_string_lossy().to_string();
            for sub in ["counters", "hw_counters"] {
                let Ok(cs) = std::fs::read_dir(p.path().join(sub)) else {
                    continue;
                };
                for c in cs.flatten() {
                    if let Some(v) = std::fs::read_to_string(c.path())
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                    {
                        out.push((
                            dev.clone(),
                            port.clone(),
                            c.file_name().to_string_lossy().to_string(),
                            v,
                        ));
                    }
                }
            }
        }
    }
    out
}

/// What the network watch reports ([`watch`]).
#[derive(Clone, Debug, PartialEq)]
pub enum NetEvent {
    /// The periodic full dump (every `network.poll_ms`).
    Dump {
        /// Every link, with its sysfs speed.
        links: Vec<LinkState>,
        /// The address table, `(ifindex, prefix_len, address)`; empty when
        /// its dump failed.
        addrs: Vec<(u32, u8, IpAddr)>,
        /// EFA/RDMA port counters ([`rdma_counters`]).
        rdma: Vec<(String, String, String, u64)>,
    },
    /// One link changed (an `RTMGRP_LINK` multicast event, at once).
    Link(LinkState),
}

/// Fills in a link's speed from sysfs.
fn with_speed(mut l: LinkState) -> LinkState {
    l.speed_mbps = sysfs_speed_mbps(&l.name);
    l
}

/// Starts the network watch: a multicast listener thread (link events at
/// once) and a periodic dump every `poll_ms` (at least 50 ms), both sending
/// on the returned channel. Both stop once the receiver is dropped (the
/// listener at its next event). Must be called inside a tokio runtime.
pub fn watch(poll_ms: u64) -> mpsc::UnboundedReceiver<NetEvent> {
    let (tx, rx) = mpsc::unbounded_channel::<NetEvent>();
    let events = tx.clone();
    std::thread::Builder::new()
        .name("kvloop-netlink".into())
        .spawn(move || listen_links(&events))
        .ok();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(poll_ms.max(50)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = tx.closed() => return,
            }
            let dump = tokio::task::spawn_blocking(|| {
                dump_links().map(|links| NetEvent::Dump {
                    links: links.into_iter().map(with_speed).collect(),
                    addrs: dump_addrs().unwrap_or_default(),
                    rdma: rdma_counters(Path::new("/sys/class/infiniband")),
                })
            })
            .await;
            match dump {
                Ok(Ok(ev)) => {
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "link dump failed"),
                Err(_) => {}
            }
        }
    });
    rx
}

/// The multicast listener: sends every link event until the receiver is
/// gone or the socket fails.
fn listen_links(tx: &mpsc::UnboundedSender<NetEvent>) {
    let mut s = match Socket::new(NETLINK_ROUTE) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "rtnetlink socket failed: no link events (periodic dump only)");
            return;
        }
    };
    if let Err(e) = s.bind(&SocketAddr::new(0, RTMGRP_LINK)) {
        tracing::warn!(error = %e, "rtnetlink multicast bind failed: no link events");
        return;
    }
    let mut buf = vec![0u8; 1 << 16];
    loop {
        buf.clear();
        buf.resize(1 << 16, 0);
        let Ok(n) = s.recv(&mut &mut buf[..], 0) else {
            return;
        };
        if tx.is_closed() {
            return;
        }
        let mut off = 0;
        while off < n {
            let Ok(m) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[off..n]) else {
                break;
            };
            let len = m.header.length as usize;
            if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) = &m.payload
                && let Some(st) = parse_link(l)
                && tx.send(NetEvent::Link(with_speed(st))).is_err()
            {
                return;
            }
            if len == 0 {
                break;
            }
            off += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(name: &str, up: bool) -> LinkState {
        LinkState {
            name: name.into(),
            up,
            ..Default::default()
        }
    }

    #[test]
    fn down_invalidates_only_paths_over_that_link() {
        let ifaces: HashMap<String, String> = [
            ("b".to_string(), "eth1".to_string()),
            ("c".into(), "eth2".into()),
        ]
        .into_iter()
        .collect();
        let mut prev = HashMap::new();
        prev.insert("eth1".to_string(), true);
        prev.insert("eth2".to_string(), true);
        let (down, up) = path_changes(&prev, &[link("eth1", false), link("eth2", true)], &ifaces);
        assert_eq!(down, vec![("b".to_string(), "eth1".to_string())]);
        assert!(up.is_empty());
        prev.insert("eth1".into(), false);
        let (down, up) = path_changes(&prev, &[link("eth1", true)], &ifaces);
        assert!(down.is_empty());
        assert_eq!(up, vec!["b".to_string()]);
        // steady down: no repeated invalidation
        let (down, _) = path_changes(&prev, &[link("eth1", false)], &ifaces);
        assert!(down.is_empty());
    }

    #[test]
    fn interface_by_longest_matching_subnet() {
        let addrs = vec![
            (1, 8, "127.0.0.1".parse().unwrap()),
            (5, 24, "10.77.0.1".parse().unwrap()),
            (6, 16, "10.77.0.9".parse().unwrap()),
            (7, 64, "fd00::1".parse().unwrap()),
        ];
        assert_eq!(iface_for("10.77.0.2".parse().unwrap(), &addrs), Some(5));
        assert_eq!(iface_for("10.77.5.2".parse().unwrap(), &addrs), Some(6));
        assert_eq!(iface_for("fd00::2".parse().unwrap(), &addrs), Some(7));
        assert_eq!(iface_for("192.168.0.1".parse().unwrap(), &addrs), None);
    }

    #[test]
    fn parses_a_link_message() {
        let mut m = LinkMessage::default();
        m.header.index = 3;
        m.header.flags = LinkFlags::Up | LinkFlags::LowerUp;
        m.attributes.push(LinkAttribute::IfName("veth0".into()));
        m.attributes.push(LinkAttribute::Mtu(9001));
        m.attributes.push(LinkAttribute::OperState(State::Up));
        let s = parse_link(&m).unwrap();
        assert!(s.up);
        assert_eq!((s.index, s.mtu, s.name.as_str()), (3, 9001, "veth0"));
        m.attributes[2] = LinkAttribute::OperState(State::Down);
        assert!(!parse_link(&m).unwrap().up);
    }

    #[test]
    fn rdma_counters_from_a_sysfs_tree() {
        let d = tempfile::tempdir().unwrap();
        let c = d.path().join("efa_0/ports/1/hw_counters");
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(c.join("rdma_read_bytes"), "12345\n").unwrap();
        let v = rdma_counters(d.path());
        assert_eq!(
            v,
            vec![("efa_0".into(), "1".into(), "rdma_read_bytes".into(), 12345)]
        );
        assert!(rdma_counters(Path::new("/nonexistent")).is_empty());
    }

    #[test]
    fn link_dump_sees_loopback() {
        let links = dump_links().expect("rtnetlink dump");
        assert!(links.iter().any(|l| l.name == "lo"), "{links:?}");
    }
}
