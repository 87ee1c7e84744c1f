//! The aggregates kept in user space: decoded events buffered between two
//! snapshots, histograms of user-space timed transfers (fallback), prefill
//! attribution counts.

use std::collections::{HashMap, VecDeque};

use crate::state::{HistogramSnapshot, PrefillSample, XferHistLabels, XferSample};
use crate::trace::Event;

/// Samples kept between two [`crate::Probes::snapshot`] calls, per kind; older
/// samples are dropped first (counted in `samples_dropped`).
pub const MAX_BUFFERED_SAMPLES: usize = 8192;

/// User-space state behind a mutex.
#[derive(Default)]
pub(crate) struct UserState {
    pub xfers: VecDeque<XferSample>,
    pub prefills: VecDeque<PrefillSample>,
    pub samples_dropped: u64,
    /// Histograms of user-space timed transfers (fallback).
    pub user_xfer_hists: HashMap<XferHistLabels, HistogramSnapshot>,
    /// Prefill requests by attribution outcome: (attributed, unattributed).
    pub prefill_attributed: u64,
    pub prefill_unattributed: u64,
    /// Token sums of attributed prefills: (prompt, reused).
    pub prefill_prompt_tokens: u64,
    pub prefill_reused_tokens: u64,
}

impl UserState {
    pub(crate) fn push(&mut self, ev: &Event) {
        match ev {
            Event::Xfer(s) => {
                if self.xfers.len() >= MAX_BUFFERED_SAMPLES {
                    self.xfers.pop_front();
                    self.samples_dropped += 1;
                }
                self.xfers.push_back(s.clone());
            }
            Event::Prefill(s) => {
                match &s.tokens {
                    Ok(t) => {
                        self.prefill_attributed += 1;
                        self.prefill_prompt_tokens += t.prompt_tokens;
                        self.prefill_reused_tokens += t.reused_tokens;
                    }
                    Err(_) => self.prefill_unattributed += 1,
                }
                if self.prefills.len() >= MAX_BUFFERED_SAMPLES {
                    self.prefills.pop_front();
                    self.samples_dropped += 1;
                }
                self.prefills.push_back(s.clone());
            }
            Event::Retransmit { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use kvloop_common::Direction;

    use super::*;
    use crate::Source;

    #[test]
    fn buffer_is_bounded() {
        let mut u = UserState::default();
        let s = XferSample {
            source: Source::Userspace,
            site: "userspace",
            tgid: 1,
            id: 1,
            start_ns: 0,
            latency_ns: 1,
            bytes: 1,
            descriptors: 1,
            direction: Direction::Unknown,
            op: kvloop_common::XferOp::Unknown,
            peer: String::new(),
            status: 0,
        };
        for _ in 0..MAX_BUFFERED_SAMPLES + 5 {
            u.push(&Event::Xfer(s.clone()));
        }
        assert_eq!(u.xfers.len(), MAX_BUFFERED_SAMPLES);
        assert_eq!(u.samples_dropped, 5);
    }
}
