//! The peer table: what this agent knows of the other node agents (their
//! HTTP address, engines and probe engine, the path's interface and
//! state), filled by asking each peer's `GET /v1/engines`.
use super::*;

/// What the agent knows about a peer agent.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeerState {
    /// Its HTTP address.
    pub http: Option<SocketAddr>,
    /// Its last `/v1/engines` answer.
    pub info: Option<EnginesInfo>,
    /// Local interface of the path.
    pub interface: Option<String>,
    /// `false` while the link under the path is down.
    pub path_valid: bool,
    /// Bandwidth alarm raised.
    pub alarm: bool,
}

/// Whether `seen` (an engine id as a probe sample carries it) names engine
/// `id`: equal, or a [`kvloop_common::PEER_LEN`]-byte truncation of it.
pub(super) fn engine_id_matches(seen: &str, id: &str) -> bool {
    id == seen || (seen.len() == kvloop_common::PEER_LEN && id.starts_with(seen))
}

impl Agent {
    /// Asks every peer agent for its engines once (`GET /v1/engines`); the
    /// discovery task calls it every second, and a READ or a renewal calls
    /// it on demand when it names an engine no known peer hosts (an engine
    /// registered since the last periodic query).
    pub async fn refresh_peers(&self) {
        let peers: Vec<(String, SocketAddr)> = self
            .peers
            .read()
            .iter()
            .filter_map(|(n, p)| p.http.map(|h| (n.clone(), h)))
            .collect();
        for (name, http) in peers {
            self.discover_peer(&name, http).await;
        }
    }

    /// Queries one peer agent's engines and records them (no connecting: a
    /// READ may be waiting on this).
    async fn discover_peer(&self, name: &str, http: SocketAddr) {
        let url = format!("http://{http}/v1/engines");
        let info = match self.http.get(&url).send().await {
            Ok(r) if r.status().is_success() => r.json::<EnginesInfo>().await.ok(),
            Ok(r) => {
                tracing::debug!(peer = %name, status = %r.status(), "peer engines query failed");
                None
            }
            Err(e) => {
                tracing::debug!(peer = %name, error = %e, "peer unreachable");
                None
            }
        };
        let Some(info) = info else { return };
        let own_probe = self.probe_engine.as_ref().map(|e| e.side_channel_addr());
        if info.agent_id == self.cfg.agent_id
            || (own_probe.is_some() && info.probe.as_ref().map(|p| p.side_channel) == own_probe)
        {
            // A peers[] entry that reaches this agent itself under another
            // name or address (a shared peer list): never probe oneself.
            tracing::info!(peer = %name, %http, "peers[]: entry is this agent itself; skipped");
            self.peers.write().remove(name);
            self.metrics.path_valid.remove(&labels(&[("peer", name)]));
            return;
        }
        if info.version != API_VERSION {
            tracing::warn!(peer = %name, version = info.version, "peer speaks another agent API version; ignored");
            return;
        }
        if let Some(p) = self.peers.write().get_mut(name) {
            p.info = Some(info);
        }
    }

    /// Names of the peer agents.
    pub fn peer_names(&self) -> Vec<String> {
        self.peers.read().keys().cloned().collect()
    }

    /// The local interface of the path to `peer`, when known.
    pub fn peer_interface(&self, peer: &str) -> Option<String> {
        self.peers
            .read()
            .get(peer)
            .and_then(|p| p.interface.clone())
    }

    /// The peer agent hosting `engine_id` (from the peers' engine lists).
    /// An id of exactly [`kvloop_common::PEER_LEN`] bytes also matches the
    /// longer ids it is a prefix of (probe samples carry truncated ids).
    pub fn peer_of_engine(&self, engine_id: &str) -> Option<String> {
        let m = |id: &str| engine_id_matches(engine_id, id);
        let peers = self.peers.read();
        peers
            .iter()
            .find(|(_, p)| {
                p.info.as_ref().is_some_and(|i| {
                    i.engines.iter().any(|e| m(&e.engine_id))
                        || i.probe.as_ref().is_some_and(|e| m(&e.engine_id))
                        || i.shaped_probes.iter().any(|e| m(&e.engine_id))
                })
            })
            .map(|(n, _)| n.clone())
    }

    /// The HTTP address of peer agent `peer`.
    pub(super) fn peer_http(&self, peer: &str) -> Option<SocketAddr> {
        self.peers.read().get(peer).and_then(|p| p.http)
    }
}
