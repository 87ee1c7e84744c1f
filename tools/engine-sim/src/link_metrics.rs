//! The node agent link's series on the engine's `/metrics` (managed mode),
//! read from the link at scrape time.
use std::sync::Arc;

use crate::managed::AgentLink;

/// The link's liveness, read at scrape time by the engine's registry:
/// `kvloop_sim_agent_connected` (gauge, 1 or 0), `kvloop_sim_agent_lost_total`
/// and `kvloop_sim_agent_reregistered_total` (counters).
pub struct AgentLinkCollector(pub Arc<AgentLink>);

impl std::fmt::Debug for AgentLinkCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AgentLinkCollector")
            .field(&self.0.path())
            .finish()
    }
}

impl prometheus_client::collector::Collector for AgentLinkCollector {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::{counter::ConstCounter, gauge::ConstGauge};
        let h = self.0.health();
        let connected = ConstGauge::new(i64::from(h.connected));
        connected.encode(enc.encode_descriptor(
            "kvloop_sim_agent_connected",
            "1 while registered with the node agent, 0 from its loss until registered again",
            None,
            connected.metric_type(),
        )?)?;
        for (name, help, n) in [
            (
                "kvloop_sim_agent_lost",
                "Times the node agent was lost (connection closed, engine unknown there)",
                h.lost_total,
            ),
            (
                "kvloop_sim_agent_reregistered",
                "Times the engine registered its KV memory again after a loss",
                h.reregistered_total,
            ),
        ] {
            let c = ConstCounter::new(n);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        Ok(())
    }
}

impl AgentLink {
    /// The link's series alone as OpenMetrics text (what
    /// [`AgentLinkCollector`] adds to the engine's `/metrics`).
    pub fn metrics_text(self: &Arc<Self>) -> String {
        let mut r = prometheus_client::registry::Registry::default();
        r.register_collector(Box::new(AgentLinkCollector(self.clone())));
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut s, &r);
        s
    }
}
