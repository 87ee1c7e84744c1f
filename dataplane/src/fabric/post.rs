//! Posting READs without ever waiting: a READ is planned
//! ([`super::plan::ReadPlan`], one per rail that carries part of it:
//! [`super::plan::plan_rails`]), recorded as pending (done when every
//! rail's part is) and queued; [`Shared::pump`]
//! posts queued groups with `fi_readmsg`, oldest READ first, while the
//! provider's queue has room. A full queue or `-FI_EAGAIN` leaves the rest
//! queued: whoever reaps completions next (the caller driving the CQ or the
//! progress thread) pumps again. So back-pressure never blocks the posting
//! thread (a tokio worker); a READ that can post nothing for
//! [`POST_WINDOW`] (a dead connection never drains) fails.
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::ffi::{fi_error_string, sys};
use super::plan::{Chunk, plan_rails};
use super::state::{Backlog, OpCtx, PeerEntry, PeerRail, Pending, Queued, Rail, Shared};
use crate::backend::{Completion, PeerSlot};
use crate::error::DataplaneError;
use crate::layout::Segment;

/// How long the oldest queued READ may go without posting a group (queue
/// full, or `-FI_EAGAIN`) before it fails.
const POST_WINDOW: Duration = Duration::from_secs(5);

/// What one `fi_readmsg` attempt did.
enum Post {
    Posted,
    /// No room now (`-FI_EAGAIN`): retry at the next pump.
    Again,
    Failed(DataplaneError),
}

impl Shared {
    /// Queues the READ of `segments` from the peer in `slot` and posts what
    /// fits now; resolves `done` when every operation finished (or was never
    /// posted). Never waits for queue space.
    pub(crate) fn post_read(&self, slot: PeerSlot, segments: &[Segment], done: Completion) {
        if !self.peers.read().get(slot.0).is_some_and(Option::is_some) {
            done.complete(Err(peer_gone(slot, "peer removed")));
            return;
        }
        let limits = self.limits;
        let read_id = self.next_read.fetch_add(1, Ordering::Relaxed);
        // With rails, a READ's bytes are split across them (small READs go
        // whole to one rail, in turn by READ id).
        let parts = plan_rails(
            segments,
            limits.max_msg_bytes,
            limits.iovs_per_read,
            (self.rails.len(), self.cfg.rail_min_bytes, read_id as usize),
        );
        if parts.is_empty() {
            done.complete(Ok(()));
            return;
        }
        self.pending.lock().insert(
            read_id,
            Pending {
                remaining: parts.iter().map(|(_, p)| p.len()).sum(),
                error: None,
                done: Some(done),
            },
        );
        let n = parts.len();
        let mut backlog = self.backlog.lock();
        for (rail, plan) in parts {
            backlog.queue.push_back(Queued {
                slot,
                rail,
                read_id,
                plan,
                next: 0,
                stalled_since: None,
            });
        }
        drop(backlog);
        self.queued.fetch_add(n, Ordering::AcqRel);
        self.pump();
        // A caller that drives the CQ after posting needs no progress thread
        // now; it hands over (and wakes it) when its spin ends.
        if self.cfg.caller_spin_us == 0 {
            self.wake();
        }
    }

    /// Posts queued groups, oldest READ first, while the provider's queue has
    /// room; fails the oldest READ when it is stalled past [`POST_WINDOW`] or
    /// its peer is gone. Never waits.
    pub(crate) fn pump(&self) {
        if self.queued.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut failed = Vec::new();
        {
            let mut backlog = self.backlog.lock();
            // Held while posting: a peer's AV entry stays valid meanwhile.
            let peers = self.peers.read();
            let b = &mut *backlog;
            // (peer, rail) pairs that answered -FI_EAGAIN in this pump: their
            // later READs wait (per-peer, per-rail order), others go on.
            let mut blocked: Vec<(usize, usize)> = Vec::new();
            // Rails whose provider queue is full: nothing more on them now.
            let mut full: Vec<bool> = self.rails.iter().map(|r| self.rail_full(r)).collect();
            let mut i = 0;
            while i < b.queue.len() && !full.iter().all(|f| *f) {
                let q = &mut b.queue[i];
                if full[q.rail] || blocked.contains(&(q.slot.0, q.rail)) {
                    i += 1;
                    continue;
                }
                let outcome = match peers.get(q.slot.0).and_then(Option::as_ref) {
                    None => Err(peer_gone(q.slot, "peer removed")),
                    Some(p) if p.gone.load(Ordering::Acquire) => Err(peer_gone(
                        q.slot,
                        "peer disconnected while the READ was being posted",
                    )),
                    Some(p) => self.post_groups(q, p, &mut b.local, &mut b.descs, &mut b.rma),
                };
                let err = match outcome {
                    Ok(true) => None,
                    Ok(false) => {
                        let since = *q.stalled_since.get_or_insert_with(Instant::now);
                        if since.elapsed() < POST_WINDOW {
                            if self.rail_full(&self.rails[q.rail]) {
                                full[q.rail] = true;
                            } else {
                                blocked.push((q.slot.0, q.rail));
                            }
                            i += 1;
                            continue;
                        }
                        Some(stalled(self))
                    }
                    Err(e) => Some(e),
                };
                let q = b.queue.remove(i).expect("index in range");
                self.queued.fetch_sub(1, Ordering::AcqRel);
                if let Some(e) = err {
                    failed.push((q.read_id, q.plan.len() - q.next, e));
                }
            }
            // A full queue for the whole window fails the oldest READ's
            // part too.
            if let Some(q) = b.queue.front_mut()
                && self.rail_full(&self.rails[q.rail])
                && q.stalled_since.get_or_insert_with(Instant::now).elapsed() >= POST_WINDOW
            {
                let q = b.queue.pop_front().expect("front exists");
                self.queued.fetch_sub(1, Ordering::AcqRel);
                failed.push((q.read_id, q.plan.len() - q.next, stalled(self)));
            }
        }
        // Outside the locks: resolving a READ runs its completion.
        for (read_id, unposted, err) in failed {
            self.finish_ops(read_id, (unposted, 0), Some(err));
        }
    }

    /// Whether `rail`'s provider queue is full (`tx_size` operations
    /// outstanding).
    fn rail_full(&self, rail: &Rail) -> bool {
        rail.outstanding.load(Ordering::Acquire) >= rail.ep.limits.tx_size
    }

    /// Posts `q`'s remaining groups on its rail while there is room:
    /// `Ok(true)` when all are posted, `Ok(false)` when the rest must wait.
    fn post_groups(
        &self,
        q: &mut Queued,
        peer: &PeerEntry,
        local: &mut Vec<sys::iovec>,
        descs: &mut Vec<*mut c_void>,
        rma: &mut Vec<sys::fi_rma_iov>,
    ) -> Result<bool, DataplaneError> {
        let rail = &self.rails[q.rail];
        let to = &peer.rails[q.rail];
        while q.next < q.plan.len() {
            if self.rail_full(rail) {
                return Ok(false);
            }
            let group = q.plan.group(q.next);
            fill_iovs(rail, to, group, local, descs, rma);
            let bytes = group.iter().map(|c| c.len).sum();
            match self.post_one(rail, to.fi_addr, (q.read_id, bytes), local, descs, rma) {
                Post::Posted => {
                    q.next += 1;
                    q.stalled_since = None;
                }
                Post::Again => return Ok(false),
                Post::Failed(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// One `fi_readmsg` on `rail` to `fi_addr` of `bytes` for READ
    /// `read_id`, with the filled IOVs.
    fn post_one(
        &self,
        rail: &Rail,
        fi_addr: u64,
        (read_id, bytes): (u64, u64),
        local: &[sys::iovec],
        descs: &mut [*mut c_void],
        rma: &[sys::fi_rma_iov],
    ) -> Post {
        let ctx = Box::into_raw(Box::new(OpCtx {
            // SAFETY: fi_context2 is plain provider scratch space; all-zero is valid.
            ctx: unsafe { std::mem::zeroed() },
            read_id,
            bytes,
        }));
        // Counted before the post: its completion may be reaped on another
        // thread before `post` returns.
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        rail.outstanding.fetch_add(1, Ordering::AcqRel);
        // SAFETY: the local IOVs point into our registrations, which live as
        // long as `self`; `ctx` is reclaimed when its completion is read (or
        // below, when the post fails).
        let r = unsafe { rail.ep.post(fi_addr, local, descs, rma, ctx as *mut c_void) };
        if r == 0 {
            return Post::Posted;
        }
        rail.outstanding.fetch_sub(1, Ordering::AcqRel);
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
        // SAFETY: not posted, so the provider never saw `ctx`: reclaim it once.
        drop(unsafe { Box::from_raw(ctx) });
        if r == -(sys::FI_EAGAIN as isize) {
            return Post::Again;
        }
        Post::Failed(DataplaneError::Backend {
            backend: rail.ep.name(),
            op: "fi_readmsg",
            code: r as i64,
            message: fi_error_string(r as i64),
        })
    }
}

/// The IOVs of one group on `rail`, local ones into the rail's
/// registrations, remote ones into the peer rail `to`'s.
fn fill_iovs(
    rail: &Rail,
    to: &PeerRail,
    group: &[Chunk],
    local: &mut Vec<sys::iovec>,
    descs: &mut Vec<*mut c_void>,
    rma: &mut Vec<sys::fi_rma_iov>,
) {
    local.clear();
    descs.clear();
    rma.clear();
    for c in group {
        let mr = &rail.mrs[c.region as usize];
        let rr = to.regions[c.region as usize];
        local.push(sys::iovec {
            iov_base: (mr.addr + c.local_offset) as *mut c_void,
            iov_len: c.len as usize,
        });
        descs.push(mr.desc);
        rma.push(sys::fi_rma_iov {
            addr: rr.base_addr + c.remote_offset,
            len: c.len as usize,
            key: rr.key,
        });
    }
}

impl Backlog {
    /// An empty backlog.
    pub(crate) fn new() -> Self {
        Self {
            queue: Default::default(),
            local: Vec::new(),
            descs: Vec::new(),
            rma: Vec::new(),
        }
    }
}

/// The error of a READ that could post nothing for [`POST_WINDOW`].
fn stalled(s: &Shared) -> DataplaneError {
    DataplaneError::Backend {
        backend: s.ep().name(),
        op: "fi_readmsg",
        code: -(sys::FI_EAGAIN as i64),
        message: format!(
            "nothing could be posted for {} s (provider queue full or -FI_EAGAIN)",
            POST_WINDOW.as_secs()
        ),
    }
}

fn peer_gone(slot: PeerSlot, reason: &str) -> DataplaneError {
    DataplaneError::PeerGone {
        engine_id: format!("slot {}", slot.0),
        reason: reason.into(),
    }
}
