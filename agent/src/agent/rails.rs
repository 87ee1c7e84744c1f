//! Bytes per rail: the libfabric backend counts the payload of the READs
//! each rail (one endpoint per `backend.rails` address) carried; the agent turns those
//! per-engine totals into `kvloop_agent_rail_bytes_total{rail,address}` over
//! every engine it runs (hosted and probe engines), at each scrape and
//! before an engine goes.
use super::*;

/// A rail's `address` label: the configured rail address, or `default`
/// (one endpoint, no `backend.rails`; NIXL reports no rails).
fn rail_address(cfg: &AgentConfig, rail: usize) -> String {
    match &cfg.backend {
        kvloop_dataplane::BackendConfig::Libfabric(f) => f
            .rails
            .get(rail)
            .filter(|a| !a.is_empty())
            .cloned()
            .unwrap_or_else(|| "default".into()),
        kvloop_dataplane::BackendConfig::Nixl(_) => "default".into(),
    }
}

impl Agent {
    /// Every engine this agent runs, keyed so that a re-registration of
    /// one engine id counts from zero again.
    fn rail_counted_engines(&self) -> Vec<(String, TransferEngine)> {
        let mut v: Vec<(String, TransferEngine)> = self
            .engines
            .read()
            .iter()
            .map(|(id, h)| (format!("{id}#{}", h.generation), h.engine.clone()))
            .collect();
        if let Some(p) = &self.probe_engine {
            v.push((p.engine_id().to_string(), p.clone()));
        }
        for s in self.shaped_probes.read().iter() {
            v.push((s.engine.engine_id().to_string(), s.engine.clone()));
        }
        v
    }

    /// Adds what each rail carried since the last call to
    /// `kvloop_agent_rail_bytes_total`, and forgets engines that are gone.
    /// Called at each `/metrics` scrape and before an engine unregisters.
    pub fn account_rail_bytes(&self) {
        let engines = self.rail_counted_engines();
        let mut seen = self.rail_seen.lock();
        let mut live = std::collections::HashSet::with_capacity(engines.len());
        for (key, engine) in engines {
            let now = engine.rail_bytes();
            let last = seen.entry(key.clone()).or_default();
            for (rail, &bytes) in now.iter().enumerate() {
                let before = last.get(rail).copied().unwrap_or(0);
                if bytes > before {
                    let rail_label = rail.to_string();
                    let address = rail_address(&self.cfg, rail);
                    self.metrics
                        .rail_bytes
                        .get_or_create(&labels(&[("rail", &rail_label), ("address", &address)]))
                        .inc_by(bytes - before);
                }
            }
            *last = now;
            live.insert(key);
        }
        seen.retain(|k, _| live.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rail_address_names_the_configured_rail_or_default() {
        let mut cfg = AgentConfig::default();
        assert_eq!(rail_address(&cfg, 0), "default");
        cfg.backend = kvloop_dataplane::BackendConfig::Libfabric(
            serde_json::from_str(r#"{"provider":"tcp;ofi_rxm","rails":["10.0.0.1","10.0.1.1"]}"#)
                .unwrap(),
        );
        assert_eq!(rail_address(&cfg, 1), "10.0.1.1");
        assert_eq!(rail_address(&cfg, 2), "default");
    }
}
