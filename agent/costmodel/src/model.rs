//! The cost model of one agent: transfer models per (peer, direction),
//! prefill models per local prefill engine, thresholds per (P, D) pair.

use crate::breakeven::{
    KvShape, PrefillCoefficients, TransferCoefficients, break_even_se_tokens, router_coefficients,
    router_xfer_cov,
};
use crate::config::{ConfigError, CostModelConfig};
use crate::samples::{
    ChangePoint, Direction, PrefillSample, Sample, SampleError, SampleModel, SampleSource,
    SourceStats, TransferSample, invalid,
};
use crate::threshold::{
    PairThresholdState, PendingMove, ThresholdChange, ThresholdState, estimate,
};
use crate::time::Instant;
use kvloop_router_api::{CostModelCoefficients, PairThreshold};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Confidence factor when the bandwidth is fixed at the config prior (all
/// READs of one size): the per-token cost then is a guess.
const PENALTY_BANDWIDTH: f64 = 0.5;
/// Confidence factor when the linear prefill cost is fixed at its prior.
const PENALTY_PREFILL_LINEAR: f64 = 0.5;
/// Confidence factor when the attention prefill cost is fixed at its prior.
const PENALTY_PREFILL_CTX: f64 = 0.8;

/// A (prefill engine, decode engine) pair whose threshold this agent computes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairSpec {
    /// Engine id of the prefill engine (on this node).
    pub prefill_engine_id: String,
    /// Engine id of the decode engine.
    pub decode_engine_id: String,
    /// Peer id (node/agent) hosting the decode engine: the transfer model used
    /// is (`decode_peer`, [`Direction::Inbound`]).
    pub decode_peer: String,
    /// Shape of the pair's KV READs.
    pub shape: KvShape,
}

impl PairSpec {
    fn validate(&self) -> Result<(), SampleError> {
        for (field, v) in [
            ("prefill_engine_id", &self.prefill_engine_id),
            ("decode_engine_id", &self.decode_engine_id),
            ("decode_peer", &self.decode_peer),
        ] {
            if v.is_empty() {
                return Err(invalid("pair", field, "\"\"", "a non-empty id"));
            }
        }
        for (field, v) in [
            ("shape.bytes_per_token", self.shape.bytes_per_token),
            ("shape.block_size_tokens", self.shape.block_size_tokens),
            ("shape.regions_per_block", self.shape.regions_per_block),
        ] {
            if v == 0 {
                return Err(invalid("pair", field, 0, "at least 1"));
            }
        }
        Ok(())
    }
}

/// Summary of a fit, for `explain` and metrics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FitSummary {
    /// Samples in the window.
    pub samples: usize,
    /// Samples kept by the robust fit.
    pub inliers: usize,
    /// Samples rejected as outliers.
    pub rejected: usize,
    /// Effective sample count under the time decay.
    pub effective_samples: f64,
    /// Robust relative scale of the residuals (0.1 = ±10 % typical error).
    pub residual_rel: f64,
    /// Per coefficient, in the model's order: fitted (`true`) or fixed at a
    /// prior / last good value (`false`).
    pub identified: [bool; 3],
    /// Confidence in `[0, 1]`.
    pub confidence: f64,
    /// Samples behind the fit, per source.
    pub sources: Vec<SourceStats>,
    /// The last regime change the detector found in this model.
    pub last_change_point: Option<ChangePoint>,
}

/// A fitted transfer model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferFit {
    /// The coefficients.
    pub coefficients: TransferCoefficients,
    /// How they were obtained (identified = [fixed, bandwidth, per-descriptor]).
    pub summary: FitSummary,
}

/// A fitted prefill model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillFit {
    /// The coefficients.
    pub coefficients: PrefillCoefficients,
    /// How they were obtained (identified = [p0, per token, per token·ctx]).
    pub summary: FitSummary,
}

/// A threshold change of one pair, as returned by [`CostModel::update`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairChange {
    /// Prefill engine id.
    pub prefill_engine_id: String,
    /// Decode engine id.
    pub decode_engine_id: String,
    /// The change.
    pub change: ThresholdChange,
}

/// Everything `kvloop explain --pair P,D` shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Explain {
    /// The pair.
    pub pair: PairSpec,
    /// Published threshold, tokens.
    pub threshold_tokens: u64,
    /// Where it comes from.
    pub state: ThresholdState,
    /// Current clamped estimate, tokens (`None` without a model).
    pub estimate_tokens: Option<u64>,
    /// Current unclamped break-even, tokens (`None` without a model or when
    /// READing never wins).
    pub break_even_tokens: Option<f64>,
    /// Standard error of the break-even relative to it (delta method from
    /// the fits' covariances); sets the hysteresis band.
    pub break_even_se_rel: Option<f64>,
    /// Pair confidence (min of transfer and prefill).
    pub confidence: f64,
    /// Hysteresis band in use, relative.
    pub band_rel: f64,
    /// A move in progress (estimate outside the band, waiting for the dwell).
    pub pending: Option<PendingMove>,
    /// Coefficients in the router's form.
    pub coefficients: Option<CostModelCoefficients>,
    /// The transfer model (decode peer, inbound).
    pub transfer: Option<TransferFit>,
    /// The prefill model of the prefill engine.
    pub prefill: Option<PrefillFit>,
    /// Last changes, oldest first.
    pub history: Vec<ThresholdChange>,
    /// When this explanation was made (injected clock), for ages of history.
    pub now: Instant,
}

#[derive(Debug)]
struct Pair {
    spec: PairSpec,
    state: PairThresholdState,
}

/// The sans-IO cost model: feed samples, call [`CostModel::update`] at
/// [`CostModel::poll_timeout`], read thresholds. No I/O, no clock.
#[derive(Debug)]
pub struct CostModel {
    config: CostModelConfig,
    transfers: BTreeMap<(String, Direction), SampleModel<TransferSample>>,
    prefills: BTreeMap<String, SampleModel<PrefillSample>>,
    pairs: BTreeMap<(String, String), Pair>,
    last_update: Option<Instant>,
}

impl CostModel {
    /// Creates a model. Errors name the bad config field.
    pub fn new(config: CostModelConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(CostModel {
            config,
            transfers: BTreeMap::new(),
            prefills: BTreeMap::new(),
            pairs: BTreeMap::new(),
            last_update: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CostModelConfig {
        &self.config
    }

    /// Adds or replaces a pair (a replaced pair keeps its threshold state).
    pub fn upsert_pair(&mut self, spec: PairSpec) -> Result<(), SampleError> {
        spec.validate()?;
        let key = (
            spec.prefill_engine_id.clone(),
            spec.decode_engine_id.clone(),
        );
        match self.pairs.get_mut(&key) {
            Some(p) => p.spec = spec,
            None => {
                let state = PairThresholdState::new(&self.config);
                self.pairs.insert(key, Pair { spec, state });
            }
        }
        Ok(())
    }

    /// Removes a pair; `true` if it existed.
    pub fn remove_pair(&mut self, prefill_engine_id: &str, decode_engine_id: &str) -> bool {
        self.pairs
            .remove(&(prefill_engine_id.to_string(), decode_engine_id.to_string()))
            .is_some()
    }

    /// Records a timed READ with `peer` in `direction`. Errors name the bad field.
    pub fn record_transfer(
        &mut self,
        peer: &str,
        direction: Direction,
        sample: TransferSample,
    ) -> Result<(), SampleError> {
        if peer.is_empty() {
            return Err(invalid("transfer", "peer", "\"\"", "a non-empty peer id"));
        }
        sample.validate()?;
        self.transfers
            .entry((peer.to_string(), direction))
            .or_default()
            .push(sample, &self.config);
        Ok(())
    }

    /// Records a timed prefill of a local prefill engine. Errors name the bad field.
    pub fn record_prefill(
        &mut self,
        prefill_engine_id: &str,
        sample: PrefillSample,
    ) -> Result<(), SampleError> {
        if prefill_engine_id.is_empty() {
            return Err(invalid(
                "prefill",
                "prefill_engine_id",
                "\"\"",
                "a non-empty engine id",
            ));
        }
        sample.validate()?;
        self.prefills
            .entry(prefill_engine_id.to_string())
            .or_default()
            .push(sample, &self.config);
        Ok(())
    }

    /// The network state says the path to `peer` is gone (link down): drops
    /// its transfer samples (both directions) and publishes
    /// `max_threshold_tokens` (recompute) for every pair over it at once.
    pub fn invalidate_peer(&mut self, peer: &str, now: Instant, detail: &str) -> Vec<PairChange> {
        for dir in [Direction::Inbound, Direction::Outbound] {
            if let Some(m) = self.transfers.get_mut(&(peer.to_string(), dir)) {
                m.clear();
            }
        }
        let cfg = &self.config;
        self.pairs
            .values_mut()
            .filter(|p| p.spec.decode_peer == peer)
            .filter_map(|p| {
                p.state
                    .invalidate(now, cfg, detail)
                    .map(|change| PairChange {
                        prefill_engine_id: p.spec.prefill_engine_id.clone(),
                        decode_engine_id: p.spec.decode_engine_id.clone(),
                        change,
                    })
            })
            .collect()
    }

    /// When the driver should next call [`CostModel::update`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        let iv = Duration::from_millis(self.config.update_interval_ms);
        Some(self.last_update.map_or(Instant::ZERO, |t| t + iv))
    }

    /// Refits every model at `now`, advances every pair's hysteresis, and
    /// returns the threshold changes.
    pub fn update(&mut self, now: Instant) -> Vec<PairChange> {
        let cfg = &self.config;
        let prior_x = [
            0.0,
            1e3 / cfg.prior_bandwidth_bytes_per_s,
            cfg.prior_per_descriptor_ms,
        ];
        let hl_x = Duration::from_millis(cfg.transfer_half_life_ms);
        for m in self.transfers.values_mut() {
            m.refit(
                now,
                hl_x,
                cfg,
                prior_x,
                [1.0, PENALTY_BANDWIDTH, 1.0],
                cfg.transfer_noise_floor_ms,
            );
        }
        let prior_p = [
            0.0,
            cfg.prior_prefill_ms_per_token,
            cfg.prior_prefill_ms_per_token_ctx,
        ];
        let hl_p = Duration::from_millis(cfg.prefill_half_life_ms);
        for m in self.prefills.values_mut() {
            m.refit(
                now,
                hl_p,
                cfg,
                prior_p,
                [1.0, PENALTY_PREFILL_LINEAR, PENALTY_PREFILL_CTX],
                0.0,
            );
        }
        self.last_update = Some(now);
        let mut changes = Vec::new();
        for pair in self.pairs.values_mut() {
            let est = pair_coefficients(&self.transfers, &self.prefills, &pair.spec)
                .map(|(c, se, epoch)| estimate(c, se, epoch, cfg));
            if let Some(change) = pair.state.step(now, cfg, est) {
                changes.push(PairChange {
                    prefill_engine_id: pair.spec.prefill_engine_id.clone(),
                    decode_engine_id: pair.spec.decode_engine_id.clone(),
                    change,
                });
            }
        }
        changes
    }

    /// Published threshold of a pair, tokens.
    pub fn threshold_tokens(&self, prefill_engine_id: &str, decode_engine_id: &str) -> Option<u64> {
        self.pair(prefill_engine_id, decode_engine_id)
            .map(|p| p.state.published)
    }

    fn pair(&self, p: &str, d: &str) -> Option<&Pair> {
        self.pairs.get(&(p.to_string(), d.to_string()))
    }

    /// The entries of a threshold push (`kvloop_router_api::ThresholdUpdate::pairs`),
    /// each valid for `valid_for` after the router receives it. `model` carries
    /// the coefficients of the current fit (with its confidence) when there is one.
    pub fn pair_thresholds(&self, valid_for: Duration) -> Vec<PairThreshold> {
        let valid_for_ms = u64::try_from(valid_for.as_millis()).unwrap_or(u64::MAX);
        self.pairs
            .values()
            .map(|p| PairThreshold {
                prefill_engine_id: p.spec.prefill_engine_id.clone(),
                decode_engine_id: p.spec.decode_engine_id.clone(),
                threshold_tokens: p.state.published,
                valid_for_ms,
                model: match p.state.state {
                    ThresholdState::Invalidated => None,
                    _ => p
                        .state
                        .last_estimate
                        .as_ref()
                        .map(|e| e.coefficients.clone()),
                },
            })
            .collect()
    }

    /// Current transfer coefficients of (`peer`, `direction`), without the
    /// fit's summary (which walks every sample): for per-READ predictions.
    pub fn transfer_coefficients(
        &self,
        peer: &str,
        direction: Direction,
    ) -> Option<TransferCoefficients> {
        transfer_coefficients(self.transfers.get(&(peer.to_string(), direction))?)
    }

    /// Current prefill coefficients of a local prefill engine, without the
    /// fit's summary: for per-READ predictions.
    pub fn prefill_coefficients(&self, prefill_engine_id: &str) -> Option<PrefillCoefficients> {
        prefill_coefficients(self.prefills.get(prefill_engine_id)?)
    }

    /// Current transfer fit of (`peer`, `direction`).
    pub fn transfer_fit(
        &self,
        peer: &str,
        direction: Direction,
        now: Instant,
    ) -> Option<TransferFit> {
        let m = self.transfers.get(&(peer.to_string(), direction))?;
        let mf = m.fit.as_ref()?;
        Some(TransferFit {
            coefficients: transfer_coefficients(m)?,
            summary: summary(m, &mf.fit, mf.confidence, now),
        })
    }

    /// Current prefill fit of a local prefill engine.
    pub fn prefill_fit(&self, prefill_engine_id: &str, now: Instant) -> Option<PrefillFit> {
        let m = self.prefills.get(prefill_engine_id)?;
        let mf = m.fit.as_ref()?;
        Some(PrefillFit {
            coefficients: prefill_coefficients(m)?,
            summary: summary(m, &mf.fit, mf.confidence, now),
        })
    }

    /// Explanation of a pair's threshold (for `kvloop explain --pair P,D`).
    pub fn explain(
        &self,
        prefill_engine_id: &str,
        decode_engine_id: &str,
        now: Instant,
    ) -> Option<Explain> {
        let p = self.pair(prefill_engine_id, decode_engine_id)?;
        let est = p.state.last_estimate.as_ref();
        Some(Explain {
            pair: p.spec.clone(),
            threshold_tokens: p.state.published,
            state: p.state.state,
            estimate_tokens: est.map(|e| e.tokens),
            break_even_tokens: est.and_then(|e| e.raw_tokens.is_finite().then_some(e.raw_tokens)),
            break_even_se_rel: est.and_then(|e| e.raw_tokens.is_finite().then_some(e.se_rel)),
            confidence: est.map_or(0.0, |e| e.coefficients.confidence),
            band_rel: p.state.band_rel,
            pending: p.state.pending.clone(),
            coefficients: est.map(|e| e.coefficients.clone()),
            transfer: self.transfer_fit(&p.spec.decode_peer, Direction::Inbound, now),
            prefill: self.prefill_fit(&p.spec.prefill_engine_id, now),
            history: p.state.history.iter().cloned().collect(),
            now,
        })
    }
}

fn summary<S: Sample>(
    m: &SampleModel<S>,
    f: &crate::fit::Fit,
    confidence: f64,
    now: Instant,
) -> FitSummary {
    FitSummary {
        samples: m.samples.len(),
        inliers: f.inliers,
        rejected: f.rejected,
        effective_samples: f.n_eff,
        residual_rel: f.sigma_rel,
        identified: f.identified,
        confidence,
        sources: m.source_stats(now),
        last_change_point: m.last_change_point.clone(),
    }
}

fn transfer_coefficients(m: &SampleModel<TransferSample>) -> Option<TransferCoefficients> {
    let b = m.fit.as_ref()?.fit.beta;
    Some(TransferCoefficients {
        fixed_ms: b[0],
        ms_per_byte: b[1],
        ms_per_descriptor: b[2],
    })
}

fn prefill_coefficients(m: &SampleModel<PrefillSample>) -> Option<PrefillCoefficients> {
    let b = m.fit.as_ref()?.fit.beta;
    Some(PrefillCoefficients {
        p0_ms: b[0],
        ms_per_token: b[1],
        ms_per_token_ctx: b[2],
    })
}

/// Router-form coefficients of a pair and the standard error of its
/// break-even, tokens.
fn pair_coefficients(
    transfers: &BTreeMap<(String, Direction), SampleModel<TransferSample>>,
    prefills: &BTreeMap<String, SampleModel<PrefillSample>>,
    spec: &PairSpec,
) -> Option<(CostModelCoefficients, f64, (u64, u64))> {
    let xm = transfers.get(&(spec.decode_peer.clone(), Direction::Inbound))?;
    let pm = prefills.get(&spec.prefill_engine_id)?;
    let x = transfer_coefficients(xm)?;
    let p = prefill_coefficients(pm)?;
    let (xf, pf) = (xm.fit.as_ref()?, pm.fit.as_ref()?);
    let conf = xf.confidence.min(pf.confidence);
    let c = router_coefficients(&x, &p, &spec.shape, conf);
    let cov_x = router_xfer_cov(&xf.fit.cov, &spec.shape);
    let pc = &pf.fit.cov;
    let cov_p = [[pc[1][1], pc[1][2]], [pc[2][1], pc[2][2]]];
    let se = break_even_se_tokens(&c, cov_x, cov_p);
    Some((c, se, (xm.change_epoch, pm.change_epoch)))
}

impl fmt::Display for Explain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs_ago = |t: Instant| self.now.saturating_duration_since(t).as_secs_f64();
        writeln!(
            f,
            "pair P={} D={} (decode peer {}, {} B/token, {} tokens/block, {} regions/block)",
            self.pair.prefill_engine_id,
            self.pair.decode_engine_id,
            self.pair.decode_peer,
            self.pair.shape.bytes_per_token,
            self.pair.shape.block_size_tokens,
            self.pair.shape.regions_per_block
        )?;
        writeln!(
            f,
            "threshold: {} tokens ({:?})",
            self.threshold_tokens, self.state
        )?;
        match (self.estimate_tokens, self.break_even_tokens) {
            (Some(e), Some(b)) => writeln!(
                f,
                "estimate:  {e} tokens (break-even {b:.0} ± {:.1} %)",
                self.break_even_se_rel.unwrap_or(0.0) * 100.0
            )?,
            (Some(e), None) => writeln!(f, "estimate:  {e} tokens (READ never wins: clamped)")?,
            _ => writeln!(f, "estimate:  none (not enough samples)")?,
        }
        writeln!(
            f,
            "confidence {:.2}, hysteresis band ±{:.0} %",
            self.confidence,
            self.band_rel * 100.0
        )?;
        if let Some(p) = &self.pending {
            writeln!(
                f,
                "pending:   moving {} to {} tokens, outside the band for {:.1} s",
                if p.upward { "up" } else { "down" },
                p.estimate_tokens,
                secs_ago(p.since)
            )?;
        }
        if let Some(c) = &self.coefficients {
            writeln!(
                f,
                "model:     t_xfer(r) = {:.3} ms + r × {:.5} ms;  t_recompute(r) = r × ({:.5} + {:.3e} × r/2) ms",
                c.xfer_fixed_ms,
                c.xfer_ms_per_token,
                c.prefill_ms_per_token,
                c.prefill_ms_per_token_ctx
            )?;
        }
        let change_point = |f: &mut fmt::Formatter<'_>, s: &FitSummary| -> fmt::Result {
            match &s.last_change_point {
                Some(c) => writeln!(
                    f,
                    "           change detected {:.1} s ago ({}): dropped {} samples older than {:.1} s ago",
                    secs_ago(c.detected_at),
                    if c.slower { "slower" } else { "faster" },
                    c.dropped,
                    secs_ago(c.since)
                ),
                None => Ok(()),
            }
        };
        let sources = |s: &FitSummary| {
            s.sources
                .iter()
                .map(|x| {
                    format!(
                        "{:?} {} (newest {:.1} s, oldest {:.1} s ago)",
                        x.source,
                        x.samples,
                        x.newest_age_ms / 1e3,
                        x.oldest_age_ms / 1e3
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some(t) = &self.transfer {
            let c = &t.coefficients;
            writeln!(
                f,
                "transfer:  a = {:.3} ms, B = {:.3} GB/s{}, c = {:.2e} ms/descriptor{}; conf {:.2}, residual ±{:.0} %, {} inliers, {} rejected",
                c.fixed_ms,
                c.bandwidth_bytes_per_s() / 1e9,
                if t.summary.identified[1] {
                    ""
                } else {
                    " (prior)"
                },
                c.ms_per_descriptor,
                if t.summary.identified[2] {
                    ""
                } else {
                    " (fixed)"
                },
                t.summary.confidence,
                t.summary.residual_rel * 100.0,
                t.summary.inliers,
                t.summary.rejected
            )?;
            writeln!(f, "           samples: {}", sources(&t.summary))?;
            change_point(f, &t.summary)?;
        }
        if let Some(p) = &self.prefill {
            let c = &p.coefficients;
            writeln!(
                f,
                "prefill:   p0 = {:.3} ms, k1 = {:.5} ms/token, k2 = {:.3e} ms/token/ctx; conf {:.2}, residual ±{:.0} %, {} inliers, {} rejected",
                c.p0_ms,
                c.ms_per_token,
                c.ms_per_token_ctx,
                p.summary.confidence,
                p.summary.residual_rel * 100.0,
                p.summary.inliers,
                p.summary.rejected
            )?;
            writeln!(f, "           samples: {}", sources(&p.summary))?;
            change_point(f, &p.summary)?;
        }
        writeln!(f, "history (oldest first):")?;
        if self.history.is_empty() {
            writeln!(f, "  (no change yet)")?;
        }
        for h in &self.history {
            writeln!(
                f,
                "  {:>8.1} s ago: {} → {} tokens, conf {:.2}: {}",
                secs_ago(h.at),
                h.from_tokens,
                h.to_tokens,
                h.confidence,
                match &h.reason {
                    crate::threshold::ChangeReason::FirstEstimate =>
                        "first confident estimate".to_string(),
                    crate::threshold::ChangeReason::OutsideBand {
                        band_rel,
                        outside_for_ms,
                        cause,
                        detail,
                    } => format!(
                        "outside ±{:.0} % for {:.1} s; cause {:?}: {}",
                        band_rel * 100.0,
                        outside_for_ms / 1e3,
                        cause,
                        detail
                    ),
                    crate::threshold::ChangeReason::PathInvalidated { detail } =>
                        format!("path invalidated: {detail}"),
                    crate::threshold::ChangeReason::RegimeChange { cause, detail } =>
                        format!("regime change detected; cause {cause:?}: {detail}"),
                    crate::threshold::ChangeReason::Refined {
                        from_se_rel,
                        to_se_rel,
                    } => format!(
                        "refined: standard error ±{:.1} % → ±{:.1} %",
                        from_se_rel * 100.0,
                        to_se_rel * 100.0
                    ),
                }
            )?;
        }
        Ok(())
    }
}

impl SampleSource {
    /// Name as used in config and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            SampleSource::Ebpf => "ebpf",
            SampleSource::Userspace => "userspace",
            SampleSource::ActiveProbe => "active_probe",
        }
    }
}
