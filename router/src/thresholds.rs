//! Recompute thresholds per (prefill, decode) engine pair (docs/protocol.md Router
//! rule 7). Pure: time is passed in as ms on the router's own clock.
//!
//! A push ([`ThresholdUpdate`]) sets, per pair, a threshold and optionally the
//! cost model behind it, valid until `receipt + valid_for_ms`. Once lapsed, the
//! static `kv_recompute_threshold` (vLLM default 64 tokens) applies again. A
//! push with a lower `seq` than the last applied one from the same agent is
//! ignored.
//!
//! A pull whose READ P's agent abandoned as slower than recomputing
//! ([`ThresholdTable::pull_cut`], from `POST /admin/pulls/abandoned`)
//! suspends pulls over that pair until a push brings a model of the pair
//! that predicts READs at least [`MODEL_MOVED_FACTOR`] slower than the one
//! in force at the cut, or for [`PULL_SUSPEND_MAX_MS`] at most: the
//! agent's model takes a few samples to move (its change detector), and a
//! second pull over a path that just slowed is cut again (seen in 2 of 27
//! runs of `make demo-cluster`, 0.2–0.4 s after the first; lifting the
//! suspension at the next push alone, 0.5 s later, still let a second cut
//! through). As outlier ejection in Envoy, for a bounded time.
use std::collections::HashMap;

use kvloop_router_api::{CostModelCoefficients, ThresholdUpdate};

/// vLLM's default `kv_recompute_threshold`, tokens (NixlConnector).
pub const DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS: u64 = 64;

/// Minimum cost-model confidence for the router to decide by the model rather
/// than by the threshold alone.
pub const MIN_MODEL_CONFIDENCE: f64 = 0.5;

/// Longest suspension of pulls over a pair after an abandoned READ, ms:
/// long enough for the agent's change detector to refit the path (about
/// 1–2 s in `make demo-cluster`), short enough that a fluke cut costs a
/// few recomputes.
pub const PULL_SUSPEND_MAX_MS: u64 = 3_000;

/// A push lifts a pair's suspension when its model predicts a READ of
/// [`MODEL_MOVED_REF_TOKENS`] at least this many times slower than the
/// model in force at the cut (the agent has learnt the path slowed).
pub const MODEL_MOVED_FACTOR: f64 = 2.0;

/// The READ size at which a moved model is judged, tokens.
pub const MODEL_MOVED_REF_TOKENS: f64 = 8_192.0;

/// A rejected push: names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ThresholdError {
    /// Field path, e.g. `pairs[0].prefill_engine_id`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// What happened to a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// Applied: number of pairs set.
    Applied(usize),
    /// Ignored: its `seq` is lower than `last_seq`, already applied from this agent.
    StaleSeq {
        /// The last applied sequence number of that agent.
        last_seq: u64,
    },
}

#[derive(Debug, Clone)]
struct PairEntry {
    threshold_tokens: u64,
    model: Option<CostModelCoefficients>,
    valid_until_ms: u64,
    agent_id: String,
    /// A READ over the pair was abandoned at this time (ms), and the
    /// model then in force predicted a READ of [`MODEL_MOVED_REF_TOKENS`]
    /// in this many ms (`None`: no model): pulls are suspended (see the
    /// module docs).
    pull_cut: Option<(u64, Option<f64>)>,
}

/// One pushed pair as `GET /admin/thresholds` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct PairSnapshot {
    /// Prefill engine id.
    pub prefill_engine_id: String,
    /// Decode engine id.
    pub decode_engine_id: String,
    /// Pushed threshold, tokens.
    pub threshold_tokens: u64,
    /// Time left before the push lapses, ms (0: lapsed, static in force).
    pub valid_for_ms_left: u64,
    /// The agent that pushed it.
    pub agent_id: String,
    /// The pushed cost model, if any.
    pub model: Option<CostModelCoefficients>,
    /// When a READ over the pair was abandoned, ms on the router's clock,
    /// while pulls over it are suspended (see the module docs).
    pub pull_cut_at_ms: Option<u64>,
}

impl PairEntry {
    /// When pulls over the pair were suspended, while they still are.
    fn suspended_at(&self, now_ms: u64) -> Option<u64> {
        self.pull_cut
            .map(|(at_ms, _)| at_ms)
            .filter(|at_ms| now_ms.saturating_sub(*at_ms) < PULL_SUSPEND_MAX_MS)
    }
}

/// Whether `model` predicts a READ of [`MODEL_MOVED_REF_TOKENS`] at least
/// [`MODEL_MOVED_FACTOR`] times slower than `ref_ms` (the model at the
/// cut; without one, any model counts as news).
fn moved(ref_ms: Option<f64>, model: Option<&CostModelCoefficients>) -> bool {
    match (ref_ms, model) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(r), Some(m)) => m.xfer_ms(MODEL_MOVED_REF_TOKENS) >= MODEL_MOVED_FACTOR * r,
    }
}

/// Where an effective threshold came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThresholdSource {
    /// A valid push.
    Pushed,
    /// The static configuration (no push, or lapsed).
    Static,
}

/// The threshold in force for one pair at one time.
#[derive(Debug, Clone, PartialEq)]
pub struct Effective {
    /// Minimum reusable tokens to pull.
    pub threshold_tokens: u64,
    /// The pushed cost model, if any and valid.
    pub model: Option<CostModelCoefficients>,
    /// Origin.
    pub source: ThresholdSource,
    /// Pulls over the pair are suspended: a READ over it was abandoned
    /// and no push has shown the path slower since
    /// ([`ThresholdTable::pull_cut`], at most [`PULL_SUSPEND_MAX_MS`]).
    pub pull_suspended: bool,
}

impl Effective {
    /// Pull `reused_tokens` tokens instead of recomputing them?
    ///
    /// With a confident cost model (confidence ≥ [`MIN_MODEL_CONFIDENCE`]):
    /// pull when `t_xfer(r) < t_recompute(r)`, where the recompute of the `r`
    /// prefix tokens is charged an average context of `r / 2` tokens
    /// (`kvloop_router_api::CostModelCoefficients`). Otherwise: pull when
    /// `r ≥ threshold_tokens`.
    ///
    /// Never while pulls over the pair are suspended (`pull_suspended`).
    pub fn should_pull(&self, reused_tokens: u64) -> bool {
        if reused_tokens == 0 || self.pull_suspended {
            return false;
        }
        if let Some(m) = &self.model
            && m.confidence >= MIN_MODEL_CONFIDENCE
        {
            let r = reused_tokens as f64;
            return m.xfer_ms(r) < m.recompute_prefix_ms(r);
        }
        reused_tokens >= self.threshold_tokens
    }

    /// TTFT a pull of `reused_tokens` saves over recomputing them, ms, by
    /// the confident cost model (`None` without one).
    pub fn saved_by_pull_ms(&self, reused_tokens: u64) -> Option<f64> {
        let m = self
            .model
            .as_ref()
            .filter(|m| m.confidence >= MIN_MODEL_CONFIDENCE)?;
        let r = reused_tokens as f64;
        Some((m.recompute_prefix_ms(r) - m.xfer_ms(r)).max(0.0))
    }
}

/// The per-pair threshold table.
#[derive(Debug, Clone)]
pub struct ThresholdTable {
    static_threshold_tokens: u64,
    pairs: HashMap<(String, String), PairEntry>,
    last_seq: HashMap<String, u64>,
}

impl ThresholdTable {
    /// An empty table falling back to `static_threshold_tokens`.
    pub fn new(static_threshold_tokens: u64) -> Self {
        Self {
            static_threshold_tokens,
            pairs: HashMap::new(),
            last_seq: HashMap::new(),
        }
    }

    /// Apply a push received at `now_ms`. `known_engine` says whether an
    /// engine id is in the registry; pushes naming unknown engines are
    /// rejected whole.
    ///
    /// # Errors
    /// [`ThresholdError`] naming the bad field (empty `agent_id`, unknown
    /// engine, non-finite or negative coefficient, confidence outside [0, 1]).
    pub fn apply(
        &mut self,
        u: &ThresholdUpdate,
        now_ms: u64,
        known_engine: impl Fn(&str) -> bool,
    ) -> Result<ApplyOutcome, ThresholdError> {
        if u.agent_id.is_empty() {
            return Err(ThresholdError {
                field: "agent_id".into(),
                message: "expected a non-empty string".into(),
            });
        }
        for (i, p) in u.pairs.iter().enumerate() {
            for (name, id) in [
                ("prefill_engine_id", &p.prefill_engine_id),
                ("decode_engine_id", &p.decode_engine_id),
            ] {
                if !known_engine(id) {
                    return Err(ThresholdError {
                        field: format!("pairs[{i}].{name}"),
                        message: format!("engine {id:?} is not in the router's registry"),
                    });
                }
            }
            if let Some(m) = &p.model {
                for (name, v) in [
                    ("xfer_fixed_ms", m.xfer_fixed_ms),
                    ("xfer_ms_per_token", m.xfer_ms_per_token),
                    ("prefill_ms_per_token", m.prefill_ms_per_token),
                    ("prefill_ms_per_token_ctx", m.prefill_ms_per_token_ctx),
                ] {
                    if !v.is_finite() || v < 0.0 {
                        return Err(ThresholdError {
                            field: format!("pairs[{i}].model.{name}"),
                            message: "expected a finite number ≥ 0".into(),
                        });
                    }
                }
                if !(0.0..=1.0).contains(&m.confidence) {
                    return Err(ThresholdError {
                        field: format!("pairs[{i}].model.confidence"),
                        message: "expected a number in [0, 1]".into(),
                    });
                }
            }
        }
        if let Some(&last) = self.last_seq.get(&u.agent_id)
            && u.seq < last
        {
            return Ok(ApplyOutcome::StaleSeq { last_seq: last });
        }
        self.last_seq.insert(u.agent_id.clone(), u.seq);
        for p in &u.pairs {
            let key = (p.prefill_engine_id.clone(), p.decode_engine_id.clone());
            // A suspension outlives pushes that still predict the path as
            // fast as at the cut.
            let pull_cut =
                self.pairs
                    .get(&key)
                    .and_then(|e| e.pull_cut)
                    .filter(|&(at_ms, ref_ms)| {
                        now_ms.saturating_sub(at_ms) < PULL_SUSPEND_MAX_MS
                            && !moved(ref_ms, p.model.as_ref())
                    });
            self.pairs.insert(
                key,
                PairEntry {
                    threshold_tokens: p.threshold_tokens,
                    model: p.model.clone(),
                    valid_until_ms: now_ms.saturating_add(p.valid_for_ms),
                    agent_id: u.agent_id.clone(),
                    pull_cut,
                },
            );
        }
        Ok(ApplyOutcome::Applied(u.pairs.len()))
    }

    /// The threshold in force for (prefill, decode) at `now_ms`.
    pub fn effective(&self, prefill: &str, decode: &str, now_ms: u64) -> Effective {
        match self.pairs.get(&(prefill.to_string(), decode.to_string())) {
            Some(e) if now_ms < e.valid_until_ms => Effective {
                threshold_tokens: e.threshold_tokens,
                model: e.model.clone(),
                source: ThresholdSource::Pushed,
                pull_suspended: e.suspended_at(now_ms).is_some(),
            },
            _ => Effective {
                threshold_tokens: self.static_threshold_tokens,
                model: None,
                source: ThresholdSource::Static,
                pull_suspended: false,
            },
        }
    }

    /// P's agent abandoned a READ over (prefill, decode) at `now_ms` as
    /// slower than recomputing: pulls over the pair stop until a push shows
    /// the path slower, for [`PULL_SUSPEND_MAX_MS`] at most (see the module
    /// docs); a cut while suspended starts the time again. Returns whether
    /// a pushed entry in force was marked (without one, the static
    /// threshold applies and nothing is suspended).
    pub fn pull_cut(&mut self, prefill: &str, decode: &str, now_ms: u64) -> bool {
        match self
            .pairs
            .get_mut(&(prefill.to_string(), decode.to_string()))
        {
            Some(e) if now_ms < e.valid_until_ms => {
                let ref_ms = e.model.as_ref().map(|m| m.xfer_ms(MODEL_MOVED_REF_TOKENS));
                e.pull_cut = Some((now_ms, ref_ms));
                true
            }
            _ => false,
        }
    }

    /// Snapshot for the admin API, by (prefill, decode).
    pub fn snapshot(&self, now_ms: u64) -> Vec<PairSnapshot> {
        let mut v: Vec<_> = self
            .pairs
            .iter()
            .map(|((p, d), e)| PairSnapshot {
                prefill_engine_id: p.clone(),
                decode_engine_id: d.clone(),
                threshold_tokens: e.threshold_tokens,
                valid_for_ms_left: e.valid_until_ms.saturating_sub(now_ms),
                agent_id: e.agent_id.clone(),
                model: e.model.clone(),
                pull_cut_at_ms: e.suspended_at(now_ms),
            })
            .collect();
        v.sort_by(|a, b| {
            (&a.prefill_engine_id, &a.decode_engine_id)
                .cmp(&(&b.prefill_engine_id, &b.decode_engine_id))
        });
        v
    }

    /// The static fallback threshold, tokens.
    pub fn static_threshold_tokens(&self) -> u64 {
        self.static_threshold_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvloop_router_api::PairThreshold;

    fn push(agent: &str, seq: u64, thr: u64, valid_for_ms: u64) -> ThresholdUpdate {
        ThresholdUpdate {
            agent_url: None,
            agent_id: agent.into(),
            seq,
            pairs: vec![PairThreshold {
                prefill_engine_id: "p0".into(),
                decode_engine_id: "d0".into(),
                threshold_tokens: thr,
                valid_for_ms,
                model: None,
            }],
        }
    }

    #[test]
    fn pushed_threshold_lapses_to_static() {
        let mut t = ThresholdTable::new(DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS);
        assert_eq!(t.effective("p0", "d0", 0).threshold_tokens, 64);
        t.apply(&push("a", 1, 2048, 1000), 100, |_| true).unwrap();
        let e = t.effective("p0", "d0", 1099);
        assert_eq!(
            (e.threshold_tokens, e.source),
            (2048, ThresholdSource::Pushed)
        );
        let e = t.effective("p0", "d0", 1100);
        assert_eq!(
            (e.threshold_tokens, e.source),
            (64, ThresholdSource::Static)
        );
        assert_eq!(t.effective("p0", "d1", 500).threshold_tokens, 64);
    }

    #[test]
    fn lower_seq_is_ignored() {
        let mut t = ThresholdTable::new(64);
        t.apply(&push("a", 5, 100, 1000), 0, |_| true).unwrap();
        assert_eq!(
            t.apply(&push("a", 4, 9999, 1000), 0, |_| true).unwrap(),
            ApplyOutcome::StaleSeq { last_seq: 5 }
        );
        assert_eq!(t.effective("p0", "d0", 1).threshold_tokens, 100);
        // another agent has its own sequence
        assert_eq!(
            t.apply(&push("b", 1, 7, 1000), 0, |_| true).unwrap(),
            ApplyOutcome::Applied(1)
        );
        assert_eq!(t.effective("p0", "d0", 1).threshold_tokens, 7);
    }

    #[test]
    fn unknown_engine_is_named() {
        let mut t = ThresholdTable::new(64);
        let e = t
            .apply(&push("a", 1, 1, 1), 0, |id| id == "p0")
            .unwrap_err();
        assert_eq!(e.field, "pairs[0].decode_engine_id");
    }

    fn with_model(seq: u64, xfer_ms_per_token: f64) -> ThresholdUpdate {
        let mut u = push("a", seq, 100, 60_000);
        u.pairs[0].model = Some(CostModelCoefficients {
            xfer_fixed_ms: 0.0,
            xfer_ms_per_token,
            prefill_ms_per_token: 0.05,
            prefill_ms_per_token_ctx: 0.0,
            confidence: 0.9,
            abandons_slow_reads: true,
            notices_abandoned_pulls: true,
            notices_read_pulls: true,
        });
        u
    }

    #[test]
    fn an_abandoned_read_suspends_pulls_until_the_model_moves_or_for_a_bounded_time() {
        let mut t = ThresholdTable::new(64);
        // Without a push in force nothing is suspended (static threshold).
        assert!(!t.pull_cut("p0", "d0", 0));
        t.apply(&with_model(1, 0.001), 0, |_| true).unwrap();
        assert!(t.effective("p0", "d0", 10).should_pull(500));
        assert!(t.pull_cut("p0", "d0", 20));
        let e = t.effective("p0", "d0", 40);
        assert!(e.pull_suspended && !e.should_pull(500), "{e:?}");
        assert_eq!(t.snapshot(40)[0].pull_cut_at_ms, Some(20));
        // A push whose model has not moved 2× keeps it.
        t.apply(&with_model(2, 0.0019), 50, |_| true).unwrap();
        assert!(t.effective("p0", "d0", 60).pull_suspended);
        // Until PULL_SUSPEND_MAX_MS after the cut.
        assert!(
            t.effective("p0", "d0", 20 + PULL_SUSPEND_MAX_MS - 1)
                .pull_suspended
        );
        let e = t.effective("p0", "d0", 20 + PULL_SUSPEND_MAX_MS);
        assert!(!e.pull_suspended && e.should_pull(500), "{e:?}");
        assert_eq!(t.snapshot(20 + PULL_SUSPEND_MAX_MS)[0].pull_cut_at_ms, None);
        // Cut again: a push showing the path 2× slower lifts it at once.
        assert!(t.pull_cut("p0", "d0", 5_000));
        t.apply(&with_model(3, 0.0019 * 2.0), 5_100, |_| true)
            .unwrap();
        assert!(!t.effective("p0", "d0", 5_200).pull_suspended);
        // A cut pair that lapsed cannot be cut (the static threshold applies).
        assert!(!t.pull_cut("p0", "d0", 70_000));
        assert!(!t.effective("p0", "d0", 70_000).pull_suspended);
    }

    #[test]
    fn model_decides_when_confident() {
        let m = CostModelCoefficients {
            xfer_fixed_ms: 30.0,
            xfer_ms_per_token: 0.001,
            prefill_ms_per_token: 0.05,
            prefill_ms_per_token_ctx: 0.0,
            confidence: 0.9,
            abandons_slow_reads: false,
            notices_abandoned_pulls: false,
            notices_read_pulls: false,
        };
        let e = Effective {
            threshold_tokens: 1,
            model: Some(m.clone()),
            source: ThresholdSource::Pushed,
            pull_suspended: false,
        };
        // break-even r* = 30 / (0.05 - 0.001) ≈ 612
        assert!(!e.should_pull(600));
        assert!(e.should_pull(700));
        let low = Effective {
            model: Some(CostModelCoefficients {
                confidence: 0.1,
                ..m
            }),
            ..e
        };
        assert!(low.should_pull(2));
    }
}
