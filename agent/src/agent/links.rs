//! What the agent does with the network watch's reports
//! ([`crate::netstate::NetEvent`]): link metrics, path invalidation when the
//! link under a peer path goes down (and validation when it comes back),
//! path interfaces resolved from the address table, RDMA port counters.
use std::net::IpAddr;

use super::*;
use crate::netstate::{LinkState, iface_for, path_changes};

impl Agent {
    /// Applies a set of link states: metrics, path invalidation and
    /// recovery. `prev_up` is the caller's memory of each link's last state
    /// (a down is acted on once, at the transition).
    pub fn apply_links(&self, prev_up: &mut HashMap<String, bool>, links: &[LinkState]) {
        for l in links {
            let lb = labels(&[("interface", &l.name)]);
            let m = &self.metrics;
            m.link_up.get_or_create(&lb).set(l.up as i64);
            m.link_mtu.get_or_create(&lb).set(l.mtu as i64);
            m.link_speed_mbps
                .get_or_create(&lb)
                .set(l.speed_mbps.unwrap_or(0) as i64);
            if l.rx_bytes > 0 || l.tx_bytes > 0 {
                m.link_rx_bytes.get_or_create(&lb).set(l.rx_bytes as i64);
                m.link_tx_bytes.get_or_create(&lb).set(l.tx_bytes as i64);
                m.link_rx_errors.get_or_create(&lb).set(l.rx_errors as i64);
                m.link_tx_errors.get_or_create(&lb).set(l.tx_errors as i64);
            }
        }
        let peer_ifaces: HashMap<String, String> = self
            .peers
            .read()
            .iter()
            .filter_map(|(n, p)| p.interface.clone().map(|i| (n.clone(), i)))
            .collect();
        let (down, up) = path_changes(prev_up, links, &peer_ifaces);
        for l in links {
            prev_up.insert(l.name.clone(), l.up);
        }
        let now = self.now();
        for (peer, iface) in &down {
            let detail = format!("link {iface} down");
            let changes = self.model.lock().invalidate_peer(peer, now, &detail);
            self.set_path_valid(peer, false);
            tracing::warn!(%peer, interface = %iface, pairs = changes.len(), "link down: path invalidated, pairs over it recompute");
            self.push_now.notify_one();
        }
        for peer in &up {
            self.set_path_valid(peer, true);
            tracing::info!(%peer, "link up: path valid again (re-measured by probes)");
        }
    }

    fn set_path_valid(&self, peer: &str, valid: bool) {
        if let Some(p) = self.peers.write().get_mut(peer) {
            p.path_valid = valid;
        }
        self.metrics
            .path_valid
            .get_or_create(&labels(&[("peer", peer)]))
            .set(valid as i64);
    }

    /// Fills in the interface of peers configured without one, from the
    /// address table (the local subnet that contains the peer's address).
    /// Peers with an interface keep it.
    pub fn resolve_interfaces(&self, links: &[LinkState], addrs: &[(u32, u8, IpAddr)]) {
        let by_index: HashMap<u32, &str> =
            links.iter().map(|l| (l.index, l.name.as_str())).collect();
        let mut peers = self.peers.write();
        for (name, p) in peers.iter_mut() {
            if p.interface.is_some() {
                continue;
            }
            let Some(http) = p.http else { continue };
            if let Some(n) = iface_for(http.ip(), addrs).and_then(|i| by_index.get(&i)) {
                tracing::info!(peer = %name, interface = %n, "path interface resolved from the address table");
                p.interface = Some(n.to_string());
            }
        }
    }

    /// Publishes EFA/RDMA port counters `(device, port, counter, value)`.
    pub fn record_rdma_counters(&self, counters: &[(String, String, String, u64)]) {
        for (dev, port, counter, v) in counters {
            self.metrics
                .rdma
                .get_or_create(&labels(&[
                    ("device", dev),
                    ("port", port),
                    ("counter", counter),
                ]))
                .set(*v as i64);
        }
    }
}
