//! This replica's compute line on one prefill engine: its outstanding
//! prefills in the order sent, and what each is (queued for compute, a
//! pull still READing D's blocks, a pull overtaken). Pure; the load book
//! ([`super::load`]) owns one per engine and decides, from the clock and
//! the agents' notices, when an item changes.
use std::collections::VecDeque;

/// This replica's prefills outstanding on one engine, oldest first, and
/// when the engine last finished the head of this line, ms.
#[derive(Default)]
pub(super) struct Fifo {
    pub(super) items: VecDeque<Item>,
    pub(super) last_done_ms: Option<u64>,
}

/// One outstanding prefill of this replica.
#[derive(Debug, Clone, Copy)]
pub(super) struct Item {
    /// Its guard.
    pub(super) id: u64,
    /// Sent at, ms.
    pub(super) sent_ms: u64,
    /// Predicted compute, µs.
    pub(super) compute_us: u64,
    /// Sent with D's params: P READs the prefix before it computes.
    pub(super) pulled: bool,
    /// A pulled prefill that a prefill sent after it has overtaken: P
    /// computed that one first, so this one is still READing D's blocks
    /// and holds no place in P's compute line (see [`super::load::PrefillGuard`]).
    pub(super) overtaken: bool,
    /// A pulled prefill whose READ P's agent abandons if it runs this long:
    /// `(at ms, compute µs of the whole prompt)`. Past `at` and still
    /// outstanding, P is recomputing it ([`Fifo::settle`]).
    pub(super) abandon: Option<(u64, u64)>,
    /// When its READ is predicted to end, ms (known where it may be
    /// abandoned: [`super::load::Abandon::read_ms`]).
    pub(super) read_end_ms: Option<u64>,
    /// P's agent notices a cut of its READ ([`super::load::Abandon::noticed`]): no
    /// assumed cut at the deadline.
    pub(super) noticed: bool,
    /// Digest of its conversation (0: none), shared with the line.
    pub(super) conversation: u64,
    /// Its pull's [`pull_digest`] (0: none or not known), matched by
    /// [`super::load::LoadBook::pull_abandoned`] and [`super::load::LoadBook::pull_read`].
    pub(super) pull: u64,
    /// P's agent notices the end of its READ ([`super::load::Pull::read_noticed`]):
    /// while `pulled`, it is READing and holds no place in P's compute
    /// line; [`super::load::LoadBook::pull_read`] queues it.
    pub(super) read_noticed: bool,
}

impl Fifo {
    /// Overtaken pulls (known to be READing) still outstanding past their
    /// abandon deadline at `now_ms` become what P now does with them: a
    /// recompute of the whole prompt, in P's line from the deadline on (its
    /// agent abandoned the READ, `kvloop_router_api::abandon`). A pull not
    /// overtaken may have its KV and wait in P's line: it stays as it is.
    /// Nor does a pull whose agent notices its cuts ([`super::load::Abandon::noticed`]):
    /// that agent cuts only a READ whose progress says so, and the notice
    /// says when ([`super::load::LoadBook::pull_abandoned`]).
    pub(super) fn settle(&mut self, now_ms: u64) {
        for x in &mut self.items {
            let due = x
                .abandon
                .filter(|a| x.overtaken && !x.noticed && a.0 <= now_ms);
            if let Some((at_ms, compute_us)) = due {
                *x = x.in_line(at_ms, compute_us);
            }
        }
    }

    /// Pulls still READing whose READ's end is noticed.
    pub(super) fn reading(&self) -> u32 {
        let n = self.items.iter().filter(|x| x.awaits_read_notice()).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The pull at `pos` has ended its READ at `now_ms`: it joins P's
    /// compute line at its tail with `compute_us` of compute (what P's
    /// engine does: it queues a request once its remote KV arrived, or its
    /// READ ended without it).
    pub(super) fn join_tail(&mut self, pos: usize, compute_us: u64, now_ms: u64) {
        if let Some(x) = self.items.remove(pos) {
            self.items.push_back(x.in_line(now_ms, compute_us));
        }
    }
}

impl Item {
    /// This prefill, no longer a pull: in P's compute line from `sent_ms`
    /// with `compute_us` of compute (its READ ended, or P recomputes).
    pub(super) fn in_line(self, sent_ms: u64, compute_us: u64) -> Item {
        Item {
            sent_ms,
            compute_us,
            pulled: false,
            overtaken: false,
            abandon: None,
            read_end_ms: None,
            ..self
        }
    }

    /// A pull still READing whose end P's agent will notice: out of P's
    /// compute line until [`super::load::LoadBook::pull_read`].
    pub(super) fn awaits_read_notice(&self) -> bool {
        self.pulled && self.read_noticed
    }

    /// In P's compute line (not READing past its turn, nor READing with
    /// its end to be noticed).
    pub(super) fn queued(&self) -> bool {
        !(self.overtaken || self.awaits_read_notice())
    }
}
