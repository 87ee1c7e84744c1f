//! Why each turn went where it went (issue 13 item 2): one [`RouteRecord`]
//! per routed turn, built from the selection (or, under `round_robin`, from
//! the round-robin pick and the threshold rule) and the reuse decision. It
//! is the debug log line, the optional `x-kvloop-route` response header
//! (`route_header = true`), the `kvloop_router_selections_total` labels and
//! an entry of [`RecentRoutes`], the ring served at `GET /admin/routes`
//! (`kvloop explain --router`). Pure: no I/O; time is passed in.
use std::collections::VecDeque;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::select::{Prediction, Selection};

/// Routed turns kept for `GET /admin/routes`.
pub const RECENT_ROUTES: usize = 512;

/// Response header carrying [`RouteRecord::line`] when `route_header = true`.
pub const ROUTE_HEADER: &str = "x-kvloop-route";

/// One predicted option, by engine id (ms).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptionRecord {
    /// Prefill engine id.
    pub prefill_engine_id: String,
    /// `pull` or `recompute`.
    pub action: String,
    /// Predicted TTFT, ms.
    pub ttft_ms: f64,
    /// Of it: waiting behind P's outstanding prefills, ms.
    pub queue_ms: f64,
    /// Of it: pulling or recomputing the reusable prefix, ms.
    pub reuse_ms: f64,
    /// Of it: computing the new suffix, ms.
    pub suffix_ms: f64,
    /// A pull whose READ P's agent abandons past this many ms (P then
    /// recomputes the whole prompt: `kvloop_router_api::abandon`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abandon_after_ms: Option<f64>,
}

/// One routed turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRecord {
    /// The request id (the client's `x-request-id`, else the router's).
    pub request_id: String,
    /// When it was routed, ms on the router's clock.
    pub at_ms: u64,
    /// `round_robin` or `predicted_ttft`.
    pub policy: String,
    /// Why P and D ([`crate::select::SelectReason`]; `round_robin` under
    /// that policy).
    pub reason: String,
    /// The reuse decision's reason ([`crate::reason::Reason`]).
    pub decision: String,
    /// Prefill engine id.
    pub prefill_engine_id: String,
    /// Decode engine id.
    pub decode_engine_id: String,
    /// Decode engine holding the previous turn, when the prefix check found one.
    pub previous_decode_engine_id: Option<String>,
    /// `pull` or `recompute`.
    pub action: String,
    /// Tokens reused (pulled).
    pub reused_tokens: u64,
    /// Tokens the previous turn's D held of this prompt (pulled or not).
    pub reusable_tokens: u64,
    /// The chosen option's prediction (`predicted_ttft` only).
    pub chosen: Option<OptionRecord>,
    /// The best option not chosen (`predicted_ttft`, two options or more).
    pub runner_up: Option<OptionRecord>,
}

fn action(pull: bool) -> &'static str {
    if pull { "pull" } else { "recompute" }
}

impl OptionRecord {
    /// From a prediction; `name` maps a registry index to its engine id.
    pub fn new(p: &Prediction, name: &impl Fn(u16) -> String) -> Self {
        Self {
            prefill_engine_id: name(p.prefill),
            action: action(p.pull).into(),
            ttft_ms: p.ttft_ms,
            queue_ms: p.queue_ms,
            reuse_ms: p.reuse_ms,
            suffix_ms: p.suffix_ms,
            abandon_after_ms: p.abandon.map(|a| a.after_ms),
        }
    }
}

/// What the request path knows when it builds a [`RouteRecord`].
#[derive(Debug, Clone, Copy)]
pub struct Routed<'a> {
    /// Request id.
    pub request_id: &'a str,
    /// Router clock, ms.
    pub at_ms: u64,
    /// Policy in force.
    pub policy: &'static str,
    /// Reuse decision's reason.
    pub decision: &'static str,
    /// Tokens reused.
    pub reused_tokens: u64,
    /// Tokens that could have been reused.
    pub reusable_tokens: u64,
    /// Previous turn's decode engine id, if any.
    pub previous_decode: Option<&'a str>,
}

impl RouteRecord {
    /// From a selection (`predicted_ttft`).
    pub fn from_selection(r: &Routed<'_>, s: &Selection, name: impl Fn(u16) -> String) -> Self {
        Self {
            request_id: r.request_id.into(),
            at_ms: r.at_ms,
            policy: r.policy.into(),
            reason: s.reason.as_str().into(),
            decision: r.decision.into(),
            prefill_engine_id: name(s.prefill),
            decode_engine_id: name(s.decode),
            previous_decode_engine_id: r.previous_decode.map(str::to_string),
            action: action(s.pull).into(),
            reused_tokens: r.reused_tokens,
            reusable_tokens: r.reusable_tokens,
            chosen: s.chosen.as_ref().map(|p| OptionRecord::new(p, &name)),
            runner_up: s.runner_up.as_ref().map(|p| OptionRecord::new(p, &name)),
        }
    }

    /// From a round-robin pick and the threshold rule (`round_robin`).
    pub fn round_robin(r: &Routed<'_>, prefill: &str, decode: &str, pull: bool) -> Self {
        Self {
            request_id: r.request_id.into(),
            at_ms: r.at_ms,
            policy: r.policy.into(),
            reason: "round_robin".into(),
            decision: r.decision.into(),
            prefill_engine_id: prefill.into(),
            decode_engine_id: decode.into(),
            previous_decode_engine_id: r.previous_decode.map(str::to_string),
            action: action(pull).into(),
            reused_tokens: r.reused_tokens,
            reusable_tokens: r.reusable_tokens,
            chosen: None,
            runner_up: None,
        }
    }

    /// One line, `key=value` separated by spaces (log line and header):
    /// `reason=predicted_pull decision=pulled prefill=p0 decode=d1
    /// action=pull reused=4096 reusable=4096 prev_decode=d2 chosen=(p0 pull ttft=12.0ms
    /// queue=0.0 reuse=3.1 suffix=8.9) runner_up=(...)`.
    pub fn line(&self) -> String {
        let mut s = format!(
            "reason={} decision={} prefill={} decode={} action={} reused={} reusable={}",
            self.reason,
            self.decision,
            self.prefill_engine_id,
            self.decode_engine_id,
            self.action,
            self.reused_tokens,
            self.reusable_tokens
        );
        if let Some(d) = &self.previous_decode_engine_id {
            let _ = write!(s, " prev_decode={d}");
        }
        for (label, o) in [("chosen", &self.chosen), ("runner_up", &self.runner_up)] {
            if let Some(o) = o {
                let _ = write!(
                    s,
                    " {label}=({} {} ttft={:.3}ms queue={:.3} reuse={:.3} suffix={:.3}",
                    o.prefill_engine_id, o.action, o.ttft_ms, o.queue_ms, o.reuse_ms, o.suffix_ms
                );
                if let Some(a) = o.abandon_after_ms {
                    let _ = write!(s, " abandon_after={a:.0}ms");
                }
                s.push(')');
            }
        }
        s
    }

    /// Predicted advantage of the chosen option over the runner-up, ms
    /// (`None` without both).
    pub fn margin_ms(&self) -> Option<f64> {
        Some(self.runner_up.as_ref()?.ttft_ms - self.chosen.as_ref()?.ttft_ms)
    }
}

/// The last [`RECENT_ROUTES`] routed turns, oldest first.
#[derive(Debug, Default)]
pub struct RecentRoutes {
    ring: VecDeque<RouteRecord>,
}

impl RecentRoutes {
    /// Keep `r`, dropping the oldest beyond [`RECENT_ROUTES`].
    pub fn push(&mut self, r: RouteRecord) {
        if self.ring.len() == RECENT_ROUTES {
            self.ring.pop_front();
        }
        self.ring.push_back(r);
    }

    /// The newest `n` (oldest first), only those of `request_id` when given.
    pub fn last(&self, n: usize, request_id: Option<&str>) -> Vec<RouteRecord> {
        let mut v: Vec<RouteRecord> = self
            .ring
            .iter()
            .rev()
            .filter(|r| request_id.is_none_or(|id| r.request_id == id))
            .take(n)
            .cloned()
            .collect();
        v.reverse();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::SelectReason;

    fn routed(id: &str) -> Routed<'_> {
        Routed {
            request_id: id,
            at_ms: 7,
            policy: "predicted_ttft",
            decision: "pulled",
            reused_tokens: 4096,
            reusable_tokens: 4096,
            previous_decode: Some("d2"),
        }
    }

    #[test]
    fn a_selection_reads_as_one_line_with_both_options() {
        let p = |prefill, pull, ttft_ms| Prediction {
            prefill,
            pull,
            ttft_ms,
            queue_ms: 1.0,
            reuse_ms: 2.0,
            suffix_ms: ttft_ms - 3.0,
            abandon: None,
            read_noticed: false,
        };
        let s = Selection {
            prefill: 0,
            decode: 3,
            pull: true,
            reason: SelectReason::PredictedPull,
            chosen: Some(p(0, true, 12.0)),
            runner_up: Some(p(1, false, 40.5)),
        };
        let names = |i: u16| ["p0", "p1", "d0", "d1"][i as usize].to_string();
        let r = RouteRecord::from_selection(&routed("r1"), &s, names);
        assert_eq!(
            r.line(),
            "reason=predicted_pull decision=pulled prefill=p0 decode=d1 action=pull reused=4096 reusable=4096 prev_decode=d2 \
             chosen=(p0 pull ttft=12.000ms queue=1.000 reuse=2.000 suffix=9.000) \
             runner_up=(p1 recompute ttft=40.500ms queue=1.000 reuse=2.000 suffix=37.500)"
        );
        assert_eq!(r.margin_ms(), Some(28.5));
        // A pull from an agent that abandons slow READs shows its deadline.
        let mut abandoning = s;
        abandoning.chosen = abandoning.chosen.map(|c| Prediction {
            abandon: Some(crate::select::load::Abandon {
                after_ms: 600.4,
                compute_ms: 900.0,
                read_ms: 150.0,
                noticed: false,
            }),
            ..c
        });
        let line = RouteRecord::from_selection(&routed("r1"), &abandoning, names).line();
        assert!(
            line.contains("chosen=(p0 pull ttft=12.000ms queue=1.000 reuse=2.000 suffix=9.000 abandon_after=600ms)"),
            "{line}"
        );
        let rr = RouteRecord::round_robin(&routed("r2"), "p1", "d0", false);
        assert_eq!(rr.margin_ms(), None);
        assert!(rr.line().starts_with(
            "reason=round_robin decision=pulled prefill=p1 decode=d0 action=recompute"
        ));
    }

    #[test]
    fn the_ring_keeps_the_newest_and_filters_by_request() {
        let mut ring = RecentRoutes::default();
        for i in 0..RECENT_ROUTES + 10 {
            let id = format!("r{i}");
            ring.push(RouteRecord::round_robin(&routed(&id), "p0", "d0", true));
        }
        let last = ring.last(3, None);
        let ids: Vec<&str> = last.iter().map(|r| r.request_id.as_str()).collect();
        let n = RECENT_ROUTES + 10;
        assert_eq!(
            ids,
            [
                format!("r{}", n - 3),
                format!("r{}", n - 2),
                format!("r{}", n - 1)
            ]
        );
        assert_eq!(ring.last(100, Some("r20")).len(), 1);
        assert!(ring.last(100, Some("r0")).is_empty(), "dropped");
    }
}
