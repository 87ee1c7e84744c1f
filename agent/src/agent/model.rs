//! The cost model's inputs and outputs as the agent drives them: refits at
//! the model's `poll_timeout` (publishing thresholds, path bandwidth and the
//! bandwidth alarm), the threshold update pushed to routers, and the
//! kernel-timed samples drained from the eBPF probes.
use std::sync::atomic::Ordering;

use kvloop_dataplane::BackendConfig;
use kvloop_router_api::ThresholdUpdate;

use super::*;

/// Bandwidth alarm rule (pure): fitted bandwidth below `ratio` × expected,
/// only once the bandwidth is identified by the fit.
pub fn bandwidth_alarm(
    fitted_bytes_per_s: f64,
    identified: bool,
    expected: f64,
    ratio: f64,
) -> bool {
    identified && fitted_bytes_per_s.is_finite() && fitted_bytes_per_s < ratio * expected
}

/// The KV shape READs of an engine registered with `layout` have: a block
/// id is `num_regions` descriptors of `block_len_bytes`, and holds
/// `block_size_tokens` tokens, so a token is `num_regions ×
/// block_len_bytes ÷ block_size_tokens` bytes on the READ path.
pub fn kv_shape_of(layout: &KvLayout) -> KvShape {
    let tokens = u64::from(layout.block_size_tokens.max(1));
    KvShape {
        bytes_per_token: (layout.bytes_per_block_id() / tokens).max(1),
        block_size_tokens: tokens,
        regions_per_block: u64::from(layout.num_regions.max(1)),
    }
}

impl Agent {
    /// A prefill engine registered (managed mode): every configured pair
    /// whose prefill engine it is takes the KV shape of its real layout
    /// ([`kv_shape_of`]) for the break-even conversion, in place of the
    /// configured `bytes_per_token` / `block_size_tokens` /
    /// `regions_per_block` (the per-descriptor term then counts the
    /// descriptors its READs really have). A difference is logged.
    pub(super) fn adopt_registered_shape(&self, engine_id: &str, layout: &KvLayout) {
        let shape = kv_shape_of(layout);
        for p in self
            .cfg
            .pairs
            .iter()
            .filter(|p| p.prefill_engine_id == engine_id)
        {
            let configured = p.spec();
            if configured.shape != shape {
                tracing::warn!(
                    prefill_engine_id = %p.prefill_engine_id,
                    decode_engine_id = %p.decode_engine_id,
                    configured = ?configured.shape,
                    registered = ?shape,
                    "pairs[]: the registered engine's layout differs from the configured KV shape; the layout's is used"
                );
            }
            if let Err(e) = self.model.lock().upsert_pair(PairSpec {
                shape,
                ..configured
            }) {
                tracing::warn!(engine_id, error = %e, "pair shape from the registered layout refused");
            }
        }
    }

    /// Refits the cost model now: logs and counts threshold changes,
    /// publishes thresholds, path bandwidth and fixed cost, and raises or
    /// clears the bandwidth alarm per peer. Returns when to refit next
    /// (the model's `poll_timeout`, on the model's clock [`Agent::now`]).
    pub fn refit(&self) -> Option<Instant> {
        let now = self.now();
        let (changes, thresholds, next) = {
            let mut m = self.model.lock();
            let c = m.update(now);
            (
                c,
                m.pair_thresholds(Duration::from_millis(1)),
                m.poll_timeout(),
            )
        };
        for c in changes {
            tracing::info!(
                prefill = %c.prefill_engine_id, decode = %c.decode_engine_id,
                from = c.change.from_tokens, to = c.change.to_tokens,
                reason = ?c.change.reason, "recompute threshold changed"
            );
            self.metrics
                .threshold_changes
                .get_or_create(&labels(&[
                    ("prefill", &c.prefill_engine_id),
                    ("decode", &c.decode_engine_id),
                ]))
                .inc();
        }
        let urgent = (!self.cfg.routers.is_empty())
            .then(|| kvloop_costmodel::urgent_push(&self.last_pushed.lock(), &thresholds))
            .flatten();
        if let Some(reason) = urgent {
            tracing::debug!(?reason, "cost model moved: thresholds pushed at once");
            self.metrics
                .pushes_early
                .get_or_create(&labels(&[("reason", reason.label())]))
                .inc();
            self.push_now.notify_one();
        }
        for t in thresholds {
            self.metrics
                .threshold
                .get_or_create(&labels(&[
                    ("prefill", &t.prefill_engine_id),
                    ("decode", &t.decode_engine_id),
                ]))
                .set(t.threshold_tokens as i64);
        }
        for peer in self.peer_names() {
            self.publish_path_fit(&peer, now);
        }
        next
    }

    fn publish_path_fit(&self, peer: &str, now: Instant) {
        let fit = self
            .model
            .lock()
            .transfer_fit(peer, CmDirection::Inbound, now);
        let Some(fit) = fit else { return };
        let bw = fit.coefficients.bandwidth_bytes_per_s();
        let l = labels(&[("peer", peer)]);
        self.metrics.path_bandwidth.get_or_create(&l).set(bw);
        self.metrics
            .path_fixed_ms
            .get_or_create(&l)
            .set(fit.coefficients.fixed_ms);
        let expected = self.expected_bandwidth(peer);
        let alarm = bandwidth_alarm(
            bw,
            fit.summary.identified[1],
            expected,
            self.cfg.probe.alarm_ratio,
        );
        let was = self
            .peers
            .write()
            .get_mut(peer)
            .map(|p| std::mem::replace(&mut p.alarm, alarm))
            .unwrap_or(false);
        if alarm && !was {
            tracing::warn!(
                %peer, fitted_gbit_s = bw * 8e-9, expected_gbit_s = expected * 8e-9,
                "path bandwidth far below what the provider should give (fallback to a slow path?)"
            );
        } else if !alarm && was {
            tracing::info!(%peer, fitted_gbit_s = bw * 8e-9, "path bandwidth back to normal");
        }
        self.metrics.path_alarm.get_or_create(&l).set(alarm as i64);
    }

    /// Bandwidth a provider should give on this node, bytes/s (for the
    /// alarm): `probe.expected_bandwidth_bytes_per_s` when set; else
    /// 12.5e9 (100 Gbit/s) for `efa`, 5e9 for `shm`, the path interface's
    /// sysfs speed for other libfabric providers (1.25e9 when unknown),
    /// 1.25e9 for NIXL.
    pub fn expected_bandwidth(&self, peer: &str) -> f64 {
        let cfg = &self.cfg.probe;
        if cfg.expected_bandwidth_bytes_per_s > 0.0 {
            return cfg.expected_bandwidth_bytes_per_s;
        }
        match &self.cfg.backend {
            BackendConfig::Libfabric(f) if f.provider.starts_with("efa") => 12.5e9,
            BackendConfig::Libfabric(f) if f.provider.starts_with("shm") => 5e9,
            BackendConfig::Libfabric(_) => self
                .peer_interface(peer)
                .and_then(|i| crate::netstate::sysfs_speed_mbps(&i))
                .map(|mbps| mbps as f64 * 125_000.0)
                .unwrap_or(1.25e9),
            BackendConfig::Nixl(_) => 1.25e9,
        }
    }

    /// Offers a transfer sample of (`peer`, `dir`) to the cost model and
    /// counts it (`kvloop_agent_model_samples_total{fit="transfer"}`).
    ///
    /// # Errors
    /// The model's [`kvloop_costmodel::SampleError`] (an invalid sample).
    pub(crate) fn model_transfer(
        &self,
        peer: &str,
        dir: CmDirection,
        s: TransferSample,
    ) -> Result<(), kvloop_costmodel::SampleError> {
        let source = s.source;
        tracing::trace!(
            %peer, ?dir, ?source, bytes = s.bytes, descriptors = s.descriptors,
            ms = s.latency.as_secs_f64() * 1e3, "transfer sample"
        );
        let r = self.model.lock().record_transfer(peer, dir, s);
        self.count_sample("transfer", source, r.is_ok());
        r
    }

    /// Offers a prefill sample of `engine_id` to the cost model and counts
    /// it (`kvloop_agent_model_samples_total{fit="prefill"}`).
    ///
    /// # Errors
    /// The model's [`kvloop_costmodel::SampleError`] (an invalid sample).
    pub(crate) fn model_prefill(
        &self,
        engine_id: &str,
        s: PrefillSample,
    ) -> Result<(), kvloop_costmodel::SampleError> {
        let source = s.source;
        let r = self.model.lock().record_prefill(engine_id, s);
        self.count_sample("prefill", source, r.is_ok());
        r
    }

    fn count_sample(&self, fit: &str, source: SampleSource, accepted: bool) {
        let source = match source {
            SampleSource::Ebpf => "ebpf",
            SampleSource::Userspace => "userspace",
            SampleSource::ActiveProbe => "active_probe",
        };
        let result = if accepted { "accepted" } else { "rejected" };
        self.metrics
            .model_samples
            .get_or_create(&labels(&[
                ("fit", fit),
                ("source", source),
                ("result", result),
            ]))
            .inc();
    }

    /// The next threshold update to push to the routers (every pair's
    /// threshold, valid for `valid_for_ms`), with the next push sequence
    /// number. A pair's model says `abandons_slow_reads` (and
    /// `notices_abandoned_pulls`) when `abandon_slow_reads` is on and this
    /// agent hosts its prefill engine (managed mode: the agent owns its
    /// READs), and `notices_read_pulls` when it hosts that engine.
    pub fn threshold_update(&self) -> ThresholdUpdate {
        let mut pairs = self
            .model
            .lock()
            .pair_thresholds(Duration::from_millis(self.cfg.valid_for_ms()));
        // This agent abandons slow READs of the prefill engines it hosts
        // (managed mode): say so, so that routers foresee P's recompute.
        for p in &mut pairs {
            if let Some(m) = &mut p.model {
                let hosted = self.engine(&p.prefill_engine_id).is_ok();
                m.abandons_slow_reads = self.cfg.abandon_slow_reads && hosted;
                // It tells the routers when it does (`crate::tasks::notices`).
                m.notices_abandoned_pulls = m.abandons_slow_reads;
                // And, owning P's READs, when one completes.
                m.notices_read_pulls = hosted;
            }
        }
        self.last_pushed.lock().clone_from(&pairs);
        ThresholdUpdate {
            agent_id: self.cfg.agent_id.clone(),
            seq: self.push_seq.fetch_add(1, Ordering::Relaxed),
            pairs,
            agent_url: Some(format!(
                "http://{}",
                SocketAddr::new(self.cfg.node_addr, self.cfg.http_listen.port())
            )),
        }
    }

    /// Waits until a push is wanted at once (a path was invalidated, or the
    /// cost model moved: [`kvloop_costmodel::urgent_push`]).
    pub async fn push_wanted(&self) {
        self.push_now.notified().await;
    }

    /// Feeds kernel-timed samples to the cost model: prefills on the
    /// configured `prefill_ports` (with their token counts), and the
    /// transfers [`crate::observe::attribute`] gives a peer (the agent's own
    /// READs; stock engines' NIXL transfers in observe mode, for processes
    /// `in_scope` says are on this node). Every transfer is counted in
    /// `kvloop_agent_kernel_transfers{site, result}`.
    pub fn ingest_kernel_samples(
        &self,
        snap: kvloop_probes::Snapshot,
        own_pid: u32,
        in_scope: &dyn Fn(u32) -> bool,
    ) {
        for p in snap.prefills {
            let Some(engine) = self.cfg.prefill_ports.iter().find(|x| x.port == p.port) else {
                continue;
            };
            let Ok(tokens) = p.tokens else { continue };
            if p.latency_ns == 0 || tokens.reused_tokens >= tokens.prompt_tokens {
                continue;
            }
            let s = PrefillSample {
                at: self.now(),
                prompt_tokens: tokens.prompt_tokens,
                reused_tokens: tokens.reused_tokens,
                latency: Duration::from_nanos(p.latency_ns),
                source: SampleSource::Ebpf,
            };
            let _ = self.model_prefill(&engine.engine_id, s);
        }
        if snap.xfers.is_empty() {
            return;
        }
        let names = self.peer_names();
        let sole_peer = (names.len() == 1).then(|| names[0].as_str());
        let peer_of = |id: &str| {
            self.peer_of_engine(id)
                .or_else(|| self.pair_decode_peer(id))
        };
        let cx = crate::observe::Context {
            own_pid,
            in_scope,
            peer_of: &peer_of,
            sole_peer,
        };
        for x in snap.xfers {
            let result = match crate::observe::attribute(&x, &cx) {
                Ok((peer, dir)) => {
                    let s = TransferSample {
                        at: self.now(),
                        bytes: x.bytes,
                        descriptors: x.descriptors as u64,
                        latency: Duration::from_nanos(x.latency_ns),
                        source: SampleSource::Ebpf,
                    };
                    let _ = self.model_transfer(&peer, dir, s);
                    "recorded"
                }
                Err(skip) => skip.as_str(),
            };
            self.metrics
                .kernel_transfers
                .get_or_create(&labels(&[("site", x.site), ("result", result)]))
                .inc();
        }
    }

    /// The decode peer of a configured pair whose decode engine id is `id`
    /// (or starts with a [`kvloop_common::PEER_LEN`]-byte truncated `id`).
    fn pair_decode_peer(&self, id: &str) -> Option<String> {
        self.cfg
            .pairs
            .iter()
            .find(|p| super::peers::engine_id_matches(id, &p.decode_engine_id))
            .map(|p| p.decode_peer.clone())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shape_of_qwen3_32b_tp8_layout() {
        // 64 layers × K/V = 128 regions of 16 tokens × 8 KV heads / TP 8 ×
        // 128 head dim × 2 bytes = 4 KiB.
        let l = kvloop_dataplane::KvLayout {
            num_regions: 128,
            num_blocks: 1000,
            block_len_bytes: 4096,
            block_size_tokens: 16,
        };
        let s = super::kv_shape_of(&l);
        assert_eq!(s.regions_per_block, 128);
        assert_eq!(s.block_size_tokens, 16);
        assert_eq!(s.bytes_per_token, 128 * 4096 / 16);
    }

    #[test]
    fn alarm_only_when_identified_and_far_below() {
        use super::bandwidth_alarm;
        assert!(bandwidth_alarm(1e8, true, 12.5e9, 0.1));
        assert!(!bandwidth_alarm(1e8, false, 12.5e9, 0.1));
        assert!(!bandwidth_alarm(2e9, true, 12.5e9, 0.1));
    }
}
