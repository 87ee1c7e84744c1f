//! Synthetic sample streams with known truth, shared by the tests and the
//! `sim_report` example. Deterministic: seeded `Xoshiro256PlusPlus`.
#![allow(dead_code)]

use kvloop_costmodel::*;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use std::time::Duration;

/// Qwen3-32B KV bytes per token in bf16: 64 layers × 8 KV heads × 128 head dim
/// × 2 (K, V) × 2 bytes (source: Qwen/Qwen3-32B `config.json`).
pub const QWEN3_32B_BYTES_PER_TOKEN: u64 = 64 * 8 * 128 * 2 * 2;

pub const SHAPE: KvShape = KvShape {
    bytes_per_token: QWEN3_32B_BYTES_PER_TOKEN,
    block_size_tokens: 16,
    regions_per_block: 128,
};

/// Prefill of Qwen3-32B on one H200-class GPU (TP=1): ~0.16 ms/token
/// (64 GFLOP/token at ~400 TFLOP/s), attention 4·64 layers·64 heads·128 dim
/// FLOP per token pair ≈ 5e-6 ms at that rate; 10 ms per request.
pub const PREFILL_TP1: PrefillCoefficients = PrefillCoefficients {
    p0_ms: 10.0,
    ms_per_token: 0.16,
    ms_per_token_ctx: 5e-6,
};
/// The same on 8 GPUs (TP=8): 8× faster per token (24k tokens ≈ 0.7 s,
/// close to the public 778 ms TTFT at 24k tokens).
pub const PREFILL_TP8: PrefillCoefficients = PrefillCoefficients {
    p0_ms: 5.0,
    ms_per_token: 0.02,
    ms_per_token_ctx: 0.65e-6,
};

/// Transfer truth for a link of `gbit_per_s`: 10 ms fixed cost per READ,
/// 0.5 µs per descriptor.
pub fn link(gbit_per_s: f64) -> TransferCoefficients {
    TransferCoefficients {
        fixed_ms: 10.0,
        ms_per_byte: 1e3 / (gbit_per_s * 1e9 / 8.0),
        ms_per_descriptor: 5e-4,
    }
}

/// True break-even by brute force with the exact descriptor count
/// `ceil(R/block) × regions`: the first R at which recompute ≥ READ,
/// clamped to `[min, max]`.
pub fn true_threshold(
    x: &TransferCoefficients,
    p: &PrefillCoefficients,
    s: &KvShape,
    min: u64,
    max: u64,
) -> u64 {
    (min..=max)
        .find(|&r| {
            p.recompute_ms(r as f64)
                >= x.predict_ms(
                    r * s.bytes_per_token,
                    r.div_ceil(s.block_size_tokens) * s.regions_per_block,
                )
        })
        .unwrap_or(max)
}

#[derive(Clone, Debug)]
pub struct SimParams {
    pub seed: u64,
    /// Multiplicative noise, uniform in `[1 - noise_rel, 1 + noise_rel]`.
    pub noise_rel: f64,
    /// Share of samples that are `outlier_factor` × slower.
    pub outlier_frac: f64,
    pub outlier_factor: f64,
    /// Active probe period (alternating 1, 64, 8, 256 blocks).
    pub probe_interval: Duration,
    /// Poisson rate of real READs (log-uniform 16..32768 tokens).
    pub traffic_per_s: f64,
    /// Poisson rate of prefills (log-uniform prompts 64..32768, half with reuse).
    pub prefill_per_s: f64,
    /// How often the driver calls `update`.
    pub update_interval: Duration,
    /// Send all READs with one shape (1 block) only.
    pub single_size: bool,
}

impl Default for SimParams {
    fn default() -> Self {
        SimParams {
            seed: 1,
            noise_rel: 0.2,
            outlier_frac: 0.0,
            outlier_factor: 10.0,
            probe_interval: Duration::from_millis(250),
            traffic_per_s: 5.0,
            prefill_per_s: 10.0,
            update_interval: Duration::from_millis(250),
            single_size: false,
        }
    }
}

pub const P: &str = "p0";
pub const D: &str = "d0";
pub const PEER: &str = "node-d";

pub struct Sim {
    pub params: SimParams,
    pub model: CostModel,
    pub now: Instant,
    pub xfer: TransferCoefficients,
    pub prefill: PrefillCoefficients,
    pub feeding: bool,
    rng: Xoshiro256PlusPlus,
    next_probe: Instant,
    next_traffic: Instant,
    next_prefill: Instant,
    next_update: Instant,
    probe_idx: usize,
    /// Every threshold change seen, with its time.
    pub changes: Vec<PairChange>,
}

const PROBE_BLOCKS: [u64; 4] = [1, 64, 8, 256];

impl Sim {
    pub fn new(
        params: SimParams,
        cfg: CostModelConfig,
        xfer: TransferCoefficients,
        prefill: PrefillCoefficients,
    ) -> Sim {
        let mut model = CostModel::new(cfg).expect("valid config");
        model
            .upsert_pair(PairSpec {
                prefill_engine_id: P.into(),
                decode_engine_id: D.into(),
                decode_peer: PEER.into(),
                shape: SHAPE,
            })
            .expect("valid pair");
        let rng = Xoshiro256PlusPlus::seed_from_u64(params.seed);
        let start = Instant::from_millis(1_000);
        Sim {
            params,
            model,
            now: start,
            xfer,
            prefill,
            feeding: true,
            rng,
            next_probe: start,
            next_traffic: start,
            next_prefill: start,
            next_update: start,
            probe_idx: 0,
            changes: Vec::new(),
        }
    }

    fn exp(&mut self, rate: f64) -> Duration {
        let u: f64 = self.rng.random_range(1e-12..1.0);
        Duration::from_secs_f64(-u.ln() / rate)
    }

    fn noisy(&mut self, ms: f64) -> Duration {
        let mut f = 1.0
            + self
                .rng
                .random_range(-self.params.noise_rel..=self.params.noise_rel);
        if self.rng.random_range(0.0..1.0) < self.params.outlier_frac {
            f *= self.params.outlier_factor;
        }
        Duration::from_secs_f64((ms * f).max(1e-6) / 1e3)
    }

    fn read(&mut self, tokens: u64, source: SampleSource) {
        let bytes = tokens * SHAPE.bytes_per_token;
        let descriptors = tokens.div_ceil(SHAPE.block_size_tokens) * SHAPE.regions_per_block;
        let latency = self.noisy(self.xfer.predict_ms(bytes, descriptors));
        let s = TransferSample {
            at: self.now,
            bytes,
            descriptors,
            latency,
            source,
        };
        self.model
            .record_transfer(PEER, Direction::Inbound, s)
            .expect("valid sample");
    }

    fn log_uniform(&mut self, lo: f64, hi: f64) -> u64 {
        (lo.ln() + self.rng.random_range(0.0..1.0) * (hi.ln() - lo.ln()))
            .exp()
            .round() as u64
    }

    /// Runs the event loop for `d` of simulated time.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            let next = self
                .next_probe
                .min(self.next_traffic)
                .min(self.next_prefill)
                .min(self.next_update);
            if next > end {
                self.now = end;
                return;
            }
            self.now = next;
            if next == self.next_update {
                let ch = self.model.update(self.now);
                self.changes.extend(ch);
                self.next_update = self.now + self.params.update_interval;
            } else if next == self.next_probe {
                if self.feeding {
                    let blocks = if self.params.single_size {
                        1
                    } else {
                        PROBE_BLOCKS[self.probe_idx % 4]
                    };
                    self.probe_idx += 1;
                    self.read(blocks * SHAPE.block_size_tokens, SampleSource::ActiveProbe);
                }
                self.next_probe = self.now + self.params.probe_interval;
            } else if next == self.next_traffic {
                if self.feeding && !self.params.single_size {
                    let tokens = self.log_uniform(16.0, 32768.0);
                    self.read(tokens, SampleSource::Ebpf);
                }
                let gap = self.exp(self.params.traffic_per_s);
                self.next_traffic = self.now + gap;
            } else {
                if self.feeding {
                    let prompt = self.log_uniform(64.0, 32768.0);
                    let reused = if self.rng.random_range(0.0..1.0) < 0.5 {
                        0
                    } else {
                        ((prompt as f64) * self.rng.random_range(0.0..0.95)) as u64
                    };
                    let latency = self.noisy(self.prefill.predict_ms(prompt - reused, reused));
                    let s = PrefillSample {
                        at: self.now,
                        prompt_tokens: prompt,
                        reused_tokens: reused,
                        latency,
                        source: SampleSource::Ebpf,
                    };
                    self.model.record_prefill(P, s).expect("valid sample");
                }
                let gap = self.exp(self.params.prefill_per_s);
                self.next_prefill = self.now + gap;
            }
        }
    }

    pub fn threshold(&self) -> u64 {
        self.model.threshold_tokens(P, D).expect("pair exists")
    }

    pub fn truth(&self) -> u64 {
        let c = self.model.config();
        true_threshold(
            &self.xfer,
            &self.prefill,
            &SHAPE,
            c.min_threshold_tokens,
            c.max_threshold_tokens,
        )
    }

    pub fn explain(&self) -> Explain {
        self.model.explain(P, D, self.now).expect("pair exists")
    }

    /// Changes at or after `t`.
    pub fn changes_since(&self, t: Instant) -> usize {
        self.changes.iter().filter(|c| c.change.at >= t).count()
    }
}

/// Changes whose direction is opposite to the previous change's (the first
/// change, from the static default, is not counted).
pub fn count_reversals(changes: &[PairChange]) -> usize {
    let dirs: Vec<bool> = changes
        .iter()
        .skip(1)
        .map(|c| c.change.to_tokens > c.change.from_tokens)
        .collect();
    dirs.windows(2).filter(|w| w[0] != w[1]).count()
}

/// Relative error of `got` against `want`.
pub fn rel_err(got: u64, want: u64) -> f64 {
    (got as f64 - want as f64).abs() / want as f64
}

/// Result of [`step_convergence`].
pub struct StepResult {
    /// From the step until the threshold is within 10 % of the new truth and
    /// stays there until the end (None if it is not at the end).
    pub converged: Option<Duration>,
    /// From the step until the threshold is first within 10 % of the new truth.
    pub reached: Option<Duration>,
    /// Threshold before the step.
    pub before: u64,
    /// True threshold after the step.
    pub truth: u64,
    pub sim: Sim,
}

/// Runs a bandwidth step (÷ `factor` after `warmup`) for `after`.
pub fn step_convergence(
    params: SimParams,
    prefill: PrefillCoefficients,
    gbit_before: f64,
    factor: f64,
    warmup: Duration,
    after: Duration,
    cfg: CostModelConfig,
) -> StepResult {
    let mut sim = Sim::new(params, cfg, link(gbit_before), prefill);
    sim.run_for(warmup);
    let before = sim.threshold();
    let t_step = sim.now;
    sim.xfer = link(gbit_before / factor);
    let truth = sim.truth();
    let tick = Duration::from_millis(50);
    let mut converged_at: Option<Instant> = None;
    let mut reached_at: Option<Instant> = None;
    let end = t_step + after;
    while sim.now < end {
        sim.run_for(tick);
        if rel_err(sim.threshold(), truth) <= 0.10 {
            converged_at.get_or_insert(sim.now);
            reached_at.get_or_insert(sim.now);
        } else {
            converged_at = None;
        }
    }
    let since = |t: Instant| t.saturating_duration_since(t_step);
    StepResult {
        converged: converged_at.map(since),
        reached: reached_at.map(since),
        before,
        truth,
        sim,
    }
}
