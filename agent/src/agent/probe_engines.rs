//! Probe engines: the configured one (`[probe]`) and one more per distinct
//! layout of the engines registered here ([`crate::probe_plan`]), their
//! paths to the peers' probe engines, and which of them probes which peer.
use super::*;
use crate::probe_plan::{self, ProbePlan, ShapeDecision};
use kvloop_agent_api::peer::ShapedProbeAddr;

/// An engine-shaped probe engine and its plan.
#[derive(Clone)]
pub(super) struct ShapedProbe {
    pub(super) plan: ProbePlan,
    pub(super) engine: TransferEngine,
}

/// One probe round's work for one peer: READs of `plan`'s two sizes by
/// `engine` from the peer's probe engine `remote_engine_id`.
#[derive(Clone)]
pub struct ProbeTarget {
    /// The peer agent's name.
    pub peer: String,
    /// The local probe engine that READs.
    pub engine: TransferEngine,
    /// The peer's probe engine of the same shape.
    pub remote_engine_id: String,
    /// Layout and READ sizes.
    pub plan: ProbePlan,
}

/// Starts a probe engine with `plan`'s layout over fresh host memory.
///
/// # Errors
/// Memory allocation or the dataplane failing to start (registration,
/// side-channel bind).
pub(super) async fn start_probe_engine(
    cfg: &AgentConfig,
    engine_id: String,
    plan: &ProbePlan,
    side_channel_port: u16,
) -> anyhow::Result<TransferEngine> {
    let layout = plan.layout;
    let regions = (0..layout.num_regions)
        .map(|i| HostRegion::new(&format!("probe{i}"), layout.region_len_bytes() as usize))
        .collect::<Result<Vec<_>, _>>()?;
    let ecfg = EngineConfig {
        engine_id,
        side_channel_addr: SocketAddr::new(cfg.node_addr, side_channel_port),
        backend: cfg.backend.clone(),
        layout,
        read_timeout_ms: cfg.read_timeout_ms.max(10_000),
        handshake_timeout_ms: 5000,
    };
    Ok(TransferEngine::start(ecfg, regions).await?)
}

/// The peer's engine-shaped probe engine with `layout`'s shape, if any.
fn peer_probe_of<'a>(info: &'a EnginesInfo, layout: &KvLayout) -> Option<&'a ShapedProbeAddr> {
    info.shaped_probes
        .iter()
        .find(|p| probe_plan::same_shape(&p.layout, layout))
}

impl Agent {
    /// Opens an engine-shaped probe engine for a newly registered engine's
    /// `layout` when probes run, `probe.follow_engines` is on and no probe
    /// engine has its shape yet. A failure is logged: probes keep their
    /// other shapes and the registration stands.
    pub(super) async fn follow_engine_layout(&self, layout: &KvLayout) {
        if self.probe_engine.is_none() || !self.cfg.probe.follow_engines {
            return;
        }
        // One at a time: two engines of one new shape open one probe engine.
        let _one = self.shape_lock.lock().await;
        let open: Vec<KvLayout> = self
            .shaped_probes
            .read()
            .iter()
            .map(|s| s.plan.layout)
            .collect();
        let plan = match probe_plan::decide(&self.cfg.probe, &open, layout) {
            ShapeDecision::Known => return,
            ShapeDecision::TooMany => {
                tracing::warn!(
                    shape = %probe_plan::shape_label(layout),
                    max = probe_plan::MAX_ENGINE_SHAPES,
                    "engine layout not followed by probes: as many engine-shaped probe engines are open as allowed"
                );
                return;
            }
            ShapeDecision::Open(p) => p,
        };
        let id = format!(
            "{PROBE_ENGINE_PREFIX}{}.{}x{}",
            self.cfg.agent_id,
            plan.shape_label(),
            plan.layout.block_size_tokens
        );
        match start_probe_engine(&self.cfg, id.clone(), &plan, 0).await {
            Ok(engine) => {
                tracing::info!(
                    engine_id = %id,
                    shape = %plan.shape_label(),
                    small_blocks = plan.small_blocks,
                    large_blocks = plan.large_blocks,
                    side_channel = %engine.side_channel_addr(),
                    "probe engine shaped like a registered engine started"
                );
                self.shaped_probes
                    .write()
                    .push(ShapedProbe { plan, engine });
            }
            Err(e) => tracing::warn!(
                shape = %plan.shape_label(),
                error = %e,
                "engine-shaped probe engine failed to start; probes keep their other shapes"
            ),
        }
    }

    /// This agent's engine-shaped probe engines as `/v1/engines` lists them.
    pub(super) fn shaped_probe_addrs(&self) -> Vec<ShapedProbeAddr> {
        self.shaped_probes
            .read()
            .iter()
            .map(|s| ShapedProbeAddr {
                engine_id: s.engine.engine_id().to_string(),
                side_channel: s.engine.side_channel_addr(),
                layout: s.plan.layout,
            })
            .collect()
    }

    /// The probe work of one round: for every known peer whose path is
    /// valid, the shapes both sides have ([`probe_plan::shapes_to_probe`]),
    /// each with the local engine and the peer's engine of that shape,
    /// where the two are connected.
    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        let Some(configured) = &self.probe_engine else {
            return Vec::new();
        };
        let configured_plan = ProbePlan::configured(&self.cfg.probe);
        let shaped = self.shaped_probes.read().clone();
        let ours: Vec<KvLayout> = shaped.iter().map(|s| s.plan.layout).collect();
        let mut out = Vec::new();
        for (name, state) in self.peers.read().iter() {
            let Some(info) = state.info.as_ref().filter(|_| state.path_valid) else {
                continue;
            };
            let theirs: Vec<KvLayout> = info.shaped_probes.iter().map(|p| p.layout).collect();
            for pick in probe_plan::shapes_to_probe(&ours, &theirs) {
                let (engine, plan, remote) = match pick {
                    Some(i) => {
                        let s = &shaped[i];
                        let remote =
                            peer_probe_of(info, &s.plan.layout).map(|p| p.engine_id.clone());
                        (&s.engine, s.plan, remote)
                    }
                    None => (
                        configured,
                        configured_plan,
                        info.probe.as_ref().map(|p| p.engine_id.clone()),
                    ),
                };
                let Some(remote_engine_id) = remote else {
                    continue;
                };
                if engine.peers().contains(&remote_engine_id) {
                    out.push(ProbeTarget {
                        peer: name.clone(),
                        engine: engine.clone(),
                        remote_engine_id,
                        plan,
                    });
                }
            }
        }
        out
    }

    /// Connects each probe engine to every known peer's probe engine of the
    /// same shape not connected yet (the discovery task's job, never a
    /// READ's).
    pub async fn connect_probe_paths(&self) {
        let Some(configured) = self.probe_engine.clone() else {
            return;
        };
        let shaped = self.shaped_probes.read().clone();
        let mut todo: Vec<(String, TransferEngine, String, SocketAddr)> = Vec::new();
        for (name, state) in self.peers.read().iter() {
            let Some(info) = &state.info else { continue };
            if let Some(pr) = &info.probe {
                todo.push((
                    name.clone(),
                    configured.clone(),
                    pr.engine_id.clone(),
                    pr.side_channel,
                ));
            }
            for s in &shaped {
                if let Some(pr) = peer_probe_of(info, &s.plan.layout) {
                    todo.push((
                        name.clone(),
                        s.engine.clone(),
                        pr.engine_id.clone(),
                        pr.side_channel,
                    ));
                }
            }
        }
        for (name, engine, remote_id, side_channel) in todo {
            if engine.peers().contains(&remote_id) {
                continue;
            }
            match engine.connect(side_channel).await {
                Ok(_) => tracing::info!(
                    peer = %name,
                    %side_channel,
                    probe_engine = %engine.engine_id(),
                    "probe path connected"
                ),
                Err(e) => tracing::warn!(peer = %name, error = %e, "probe path connect failed"),
            }
        }
    }
}
