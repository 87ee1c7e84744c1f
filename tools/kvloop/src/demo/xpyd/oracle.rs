//! The cluster demo's oracle and statistics. Pure: no I/O.
//!
//! **Regret** (issue 13 item 3): for every turn, every feasible choice (each
//! prefill engine P', pulling the reusable prefix from the previous D or
//! recomputing it) is costed with the same ground truth, and the chosen
//! option's cost is compared with the cheapest:
//!
//! ```text
//! cost(P', pull)      = backlog(P', t) + xfer(P', D_prev, r) + prefill(n − r, r)
//! cost(P', recompute) = backlog(P', t) + prefill(n, 0)
//! regret              = Σ (cost(chosen) − min cost) / Σ min cost
//! ```
//!
//! - `prefill(new, ctx)` is the engines' own cost profile
//!   (`kvloop-engine-sim`'s `profile` module, read from `/sim/stats`) times
//!   their `--time-scale`;
//! - `xfer(P, D, r)` is a least-squares line (fixed + per token) through
//!   the D→P READs P really did over that path in the scenario
//!   (`/sim/reads`), fitted separately inside and outside a degraded
//!   window;
//! - `backlog(P', t)`: the compute still ahead of a request that becomes
//!   ready on P' at `t` (P' computes one prefill at a time, FIFO): the sum,
//!   over the prefills of the run on P' ready before `t` and not finished at
//!   `t`, of their compute after `t` (`/sim/prefills`).
//!
//! A pull whose READ failed or was abandoned (the engine recomputed) is
//! costed as what it cost: `backlog + the wait for the READ + prefill(n, 0)`.
//!
//! The oracle is one-step (it keeps the run's observed queues, which its
//! own choices would have changed) and ignores the P→D READ (D reading
//! the prompt's KV from P). Every option pays that alike only where P's
//! paths to D are alike: with `d0 ↔ p0` lowered, a turn placed on p0 with
//! D = d0 paid 3.2 s for 38k tokens that neither the selection nor this
//! oracle costs (2026-12-07; the selection chooses D by load).

/// Engine prefill profile (ms): `t0 + new × (a + b × (ctx + new/2))`, scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Profile {
    /// Fixed cost, ms.
    pub t0_ms: f64,
    /// ms per token.
    pub a_ms_per_token: f64,
    /// ms per token per token of context.
    pub b_ms_per_token2: f64,
    /// `--time-scale` of the engines.
    pub time_scale: f64,
}

impl Profile {
    /// Compute time of `new` tokens after `ctx` cached ones, ms.
    pub fn prefill_ms(&self, new: u64, ctx: u64) -> f64 {
        if new == 0 {
            return 0.0;
        }
        let (n, c) = (new as f64, ctx as f64);
        (self.t0_ms + n * (self.a_ms_per_token + self.b_ms_per_token2 * (c + n / 2.0)))
            * self.time_scale
    }
}

/// A transfer line: `fixed_ms + tokens × ms_per_token`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    /// ms.
    pub fixed_ms: f64,
    /// ms per token.
    pub ms_per_token: f64,
}

impl Line {
    /// ms for `tokens`.
    pub fn at(&self, tokens: u64) -> f64 {
        self.fixed_ms + self.ms_per_token * tokens as f64
    }

    /// Least squares through `(tokens, ms)`; a line through the origin's
    /// mean slope with fewer than 2 distinct sizes; `None` when empty.
    pub fn fit(points: &[(u64, f64)]) -> Option<Line> {
        if points.is_empty() {
            return None;
        }
        let n = points.len() as f64;
        let mx = points.iter().map(|p| p.0 as f64).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 as f64 - mx).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 as f64 - mx) * (p.1 - my)).sum();
        if sxx <= f64::EPSILON || mx <= 0.0 {
            return Some(Line {
                fixed_ms: 0.0,
                ms_per_token: if mx > 0.0 { my / mx } else { 0.0 },
            });
        }
        let slope = (sxy / sxx).max(0.0);
        Some(Line {
            fixed_ms: (my - slope * mx).max(0.0),
            ms_per_token: slope,
        })
    }
}

/// One prefill a P computed (Unix ms).
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// P's engine id.
    pub prefill: String,
    /// Ready to compute (arrival + READ), Unix ms.
    pub ready_ms: f64,
    /// Compute began, Unix ms.
    pub start_ms: f64,
    /// Compute ended, Unix ms.
    pub end_ms: f64,
}

/// One routed turn as the oracle sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The router's request id (for the costliest-turns list).
    pub request_id: String,
    /// When it reached P (or was sent), Unix ms.
    pub at_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens the previous D held of the prompt (0: nothing to reuse).
    pub reusable_tokens: u64,
    /// That D's engine id.
    pub prev_decode: Option<String>,
    /// Chosen P.
    pub prefill: String,
    /// Pulled (else recomputed).
    pub pulled: bool,
    /// A pull whose READ failed or was abandoned this many ms after the
    /// turn reached P (the engine then recomputed everything): costed as
    /// what it cost, that wait plus the recompute option, not as a READ.
    /// `None` for a turn that was not pulled.
    pub read_failed_after_ms: Option<f64>,
}

/// Compute ahead of a request ready on `p` at `t`, ms.
pub fn backlog_ms(spans: &[Span], p: &str, t: f64) -> f64 {
    spans
        .iter()
        .filter(|s| s.prefill == p && s.ready_ms < t && s.end_ms > t)
        .map(|s| s.end_ms - s.start_ms.max(t))
        .sum()
}

/// How many of a run's costliest turns [`Regret::worst`] keeps.
pub const WORST_TURNS: usize = 5;

/// One option of a turn and its oracle cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Costed {
    /// Prefill engine id.
    pub prefill: String,
    /// Pull (else recompute).
    pub pull: bool,
    /// Oracle cost, ms.
    pub cost_ms: f64,
}

/// A turn whose choice cost more than the oracle's.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnLoss {
    /// The turn's request id.
    pub request_id: String,
    /// When it reached P, Unix ms.
    pub at_ms: f64,
    /// The choice made.
    pub chosen: Costed,
    /// The oracle's choice.
    pub best: Costed,
}

impl TurnLoss {
    /// `chosen − best`, ms.
    pub fn loss_ms(&self) -> f64 {
        self.chosen.cost_ms - self.best.cost_ms
    }
}

/// The regret of a run's choices.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Regret {
    /// Σ cost of the chosen options, ms.
    pub chosen_ms: f64,
    /// Σ cost of the cheapest options, ms.
    pub oracle_ms: f64,
    /// Turns costed.
    pub turns: usize,
    /// Turns whose choice was the cheapest (within 1 %).
    pub best_chosen: usize,
    /// The [`WORST_TURNS`] turns that cost the most over the oracle, worst
    /// first.
    pub worst: Vec<TurnLoss>,
}

impl Regret {
    /// `(chosen − oracle) / oracle`, 0 without turns.
    pub fn ratio(&self) -> f64 {
        if self.oracle_ms > 0.0 {
            (self.chosen_ms - self.oracle_ms) / self.oracle_ms
        } else {
            0.0
        }
    }
}

/// Costs every turn's options (see the module docs). `prefills` are the
/// P engine ids; `xfer(p, d, t)` the path line in force at `t` (`None`:
/// that path never READ, so pulling over it is not costed and not
/// feasible).
pub fn regret(
    turns: &[Turn],
    spans: &[Span],
    prefills: &[String],
    profile: &Profile,
    xfer: impl Fn(&str, &str, f64) -> Option<Line>,
) -> Regret {
    let mut r = Regret::default();
    for t in turns {
        let n = t.prompt_tokens;
        let reuse = t.reusable_tokens.min(n);
        let cost = |p: &str, pull: bool| -> Option<f64> {
            let q = backlog_ms(spans, p, t.at_ms);
            if pull {
                let d = t.prev_decode.as_deref()?;
                if reuse == 0 {
                    return None;
                }
                let line = xfer(p, d, t.at_ms)?;
                Some(q + line.at(reuse) + profile.prefill_ms(n - reuse, reuse))
            } else {
                Some(q + profile.prefill_ms(n, 0))
            }
        };
        let chosen = match t.read_failed_after_ms {
            Some(wait_ms) => cost(&t.prefill, false).map(|c| c + wait_ms),
            None => cost(&t.prefill, t.pulled),
        };
        let Some(chosen) = chosen else {
            continue;
        };
        let made = Costed {
            prefill: t.prefill.clone(),
            pull: t.pulled,
            cost_ms: chosen,
        };
        let mut best = made.clone();
        for p in prefills {
            for pull in [false, true] {
                if let Some(c) = cost(p, pull).filter(|c| *c < best.cost_ms) {
                    best = Costed {
                        prefill: p.clone(),
                        pull,
                        cost_ms: c,
                    };
                }
            }
        }
        r.chosen_ms += chosen;
        r.oracle_ms += best.cost_ms;
        r.turns += 1;
        if chosen <= best.cost_ms * 1.01 {
            r.best_chosen += 1;
        } else {
            r.worst.push(TurnLoss {
                request_id: t.request_id.clone(),
                at_ms: t.at_ms,
                chosen: made,
                best,
            });
        }
    }
    r.worst.sort_by(|a, b| b.loss_ms().total_cmp(&a.loss_ms()));
    r.worst.truncate(WORST_TURNS);
    r
}

/// The `q`-quantile (0..=1, nearest rank) of `v`; NaN when empty.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAT: Profile = Profile {
        t0_ms: 0.0,
        a_ms_per_token: 0.1,
        b_ms_per_token2: 0.0,
        time_scale: 1.0,
    };

    fn turn(p: &str, pulled: bool) -> Turn {
        Turn {
            request_id: format!("t-{p}-{pulled}"),
            at_ms: 1000.0,
            prompt_tokens: 2000,
            reusable_tokens: 1000,
            prev_decode: Some("d0".into()),
            prefill: p.into(),
            pulled,
            read_failed_after_ms: None,
        }
    }

    #[test]
    fn a_line_fits_reads_and_a_profile_scales() {
        let l = Line::fit(&[(100, 12.0), (200, 22.0), (300, 32.0)]).unwrap();
        assert!((l.fixed_ms - 2.0).abs() < 1e-9 && (l.ms_per_token - 0.1).abs() < 1e-9);
        let one = Line::fit(&[(100, 10.0), (100, 30.0)]).unwrap();
        assert_eq!((one.fixed_ms, one.ms_per_token), (0.0, 0.2));
        assert!(Line::fit(&[]).is_none());
        let p = Profile {
            time_scale: 0.5,
            t0_ms: 20.0,
            ..FLAT
        };
        assert_eq!(p.prefill_ms(100, 0), 15.0);
        assert_eq!(p.prefill_ms(0, 100), 0.0);
    }

    #[test]
    fn backlog_counts_the_compute_still_ahead() {
        let s = |p: &str, ready, start, end| Span {
            prefill: p.into(),
            ready_ms: ready,
            start_ms: start,
            end_ms: end,
        };
        let spans = [
            s("p0", 0.0, 0.0, 100.0),
            s("p0", 10.0, 100.0, 150.0),
            s("p0", 200.0, 200.0, 300.0),
            s("p1", 0.0, 0.0, 500.0),
        ];
        assert_eq!(backlog_ms(&spans, "p0", 50.0), 50.0 + 50.0);
        assert_eq!(backlog_ms(&spans, "p0", 160.0), 0.0);
        assert_eq!(backlog_ms(&spans, "p1", 400.0), 100.0);
    }

    #[test]
    fn the_slow_path_pull_is_regret_and_the_fast_one_is_not() {
        // p1 → d0 slow (1 ms/token), p0 → d0 fast (0.01 ms/token).
        let xfer = |p: &str, _d: &str, _t: f64| {
            Some(Line {
                fixed_ms: 0.0,
                ms_per_token: if p == "p1" { 1.0 } else { 0.01 },
            })
        };
        let ps = ["p0".to_string(), "p1".to_string()];
        // Fast pull: 10 + 100 = 110 ms, the best.
        let good = regret(&[turn("p0", true)], &[], &ps, &FLAT, xfer);
        assert_eq!((good.turns, good.best_chosen), (1, 1));
        assert!(good.ratio().abs() < 1e-12);
        // Slow pull: 1000 + 100 = 1100 ms vs 110 → regret 9×.
        let bad = regret(&[turn("p1", true)], &[], &ps, &FLAT, xfer);
        assert!((bad.ratio() - 9.0).abs() < 1e-9, "{bad:?}");
        // ... listed as the worst turn, with the oracle's choice.
        let w = &bad.worst[0];
        assert_eq!((w.best.prefill.as_str(), w.best.pull), ("p0", true));
        assert!((w.loss_ms() - 990.0).abs() < 1e-9, "{w:?}");
        assert!(good.worst.is_empty());
        // Recompute on p1 (200 ms) vs 110.
        let rec = regret(&[turn("p1", false)], &[], &ps, &FLAT, xfer);
        assert!((rec.ratio() - 90.0 / 110.0).abs() < 1e-9);
        // A busy p0 (1 s of backlog) makes recompute on p1 the best.
        let busy = [Span {
            prefill: "p0".into(),
            ready_ms: 0.0,
            start_ms: 0.0,
            end_ms: 2000.0,
        }];
        let r = regret(&[turn("p1", false)], &busy, &ps, &FLAT, xfer);
        assert_eq!(r.best_chosen, 1);
        // A slow pull abandoned after 300 ms: 300 + 200 (recompute) = 500.
        let abandoned = Turn {
            read_failed_after_ms: Some(300.0),
            ..turn("p1", true)
        };
        let a = regret(&[abandoned], &[], &ps, &FLAT, xfer);
        assert!((a.worst[0].chosen.cost_ms - 500.0).abs() < 1e-9, "{a:?}");
        // No path line: pulling is not feasible, recompute is the oracle.
        let none = regret(&[turn("p0", false)], &[], &ps, &FLAT, |_, _, _| None);
        assert_eq!(none.best_chosen, 1);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 5.0);
        assert_eq!(quantile(&v, 0.9), 9.0);
        assert_eq!(quantile(&v, 0.99), 10.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
