//! Recompute thresholds per (prefill, decode) engine pair (docs/protocol.md Router
//! rule 7). Pure: time is passed in as ms on the router's own clock.
//!
//! A push ([`ThresholdUpdate`]) sets, per pair, a threshold and optionally the
//! cost model behind it, valid until `receipt + valid_for_ms`. Once lapsed, the
//! static `kv_recompute_threshold` (vLLM default 64 tokens) applies again. A
//! push with a lower `seq` than the last applied one from the same agent is
//! ignored.
use std::collections::HashMap;

use kvloop_router_api::{CostModelCoefficients, ThresholdUpdate};

/// vLLM's default `kv_recompute_threshold`, tokens (NixlConnector).
pub const DEFAULT_KV_RECOMPUTE_THRESHOLD_TOKENS: u64 = 64;

/// Minimum cost-model confidence for the router to decide by the model rather
/// than by the threshold alone.
pub const MIN_MODEL_CONFIDENCE: f64 = 0.5;

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
}

impl Effective {
    /// Pull `reused_tokens` tokens instead of recomputing them?
    ///
    /// With a confident cost model (confidence ≥ [`MIN_MODEL_CONFIDENCE`]):
    /// pull when `t_xfer(r) < t_recompute(r)`, where the recompute of the `r`
    /// prefix tokens is charged an average context of `r / 2` tokens
    /// (`kvloop_router_api::CostModelCoefficients`). Otherwise: pull when
    /// `r ≥ threshold_tokens`.
    pub fn should_pull(&self, reused_tokens: u64) -> bool {
        if reused_tokens == 0 {
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
            self.pairs.insert(
                (p.prefill_engine_id.clone(), p.decode_engine_id.clone()),
                PairEntry {
                    threshold_tokens: p.threshold_tokens,
                    model: p.model.clone(),
                    valid_until_ms: now_ms.saturating_add(p.valid_for_ms),
                    agent_id: u.agent_id.clone(),
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
            },
            _ => Effective {
                threshold_tokens: self.static_threshold_tokens,
                model: None,
                source: ThresholdSource::Static,
            },
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
