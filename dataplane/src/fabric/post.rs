//! Posting one READ: plan it ([`super::plan::ReadPlan`]), record it as
//! pending, then post each group with `fi_readmsg`, within the provider's
//! queue depth and retrying `-FI_EAGAIN` for a bounded time.
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::ffi::{fi_error_string, sys};
use super::plan::{Chunk, ReadPlan};
use super::state::{OpCtx, PeerEntry, Pending, Shared};
use crate::backend::{Completion, PeerSlot};
use crate::error::DataplaneError;
use crate::layout::Segment;

/// How long one group may wait for queue space or retry `-FI_EAGAIN`.
const POST_WINDOW: Duration = Duration::from_secs(5);

/// The IOVs of one `fi_readmsg`.
struct Iovs {
    local: Vec<sys::iovec>,
    descs: Vec<*mut c_void>,
    rma: Vec<sys::fi_rma_iov>,
}

impl Shared {
    /// Posts the READ of `segments` from the peer in `slot`; resolves `done`
    /// when every operation finished (or was never posted).
    pub(crate) fn post_read(&self, slot: PeerSlot, segments: &[Segment], done: Completion) {
        // Held until every group is posted: the peer's AV entry stays valid.
        let peers = self.peers.read();
        let Some(peer) = peers.get(slot.0).and_then(Option::as_ref) else {
            drop(peers);
            done.complete(Err(DataplaneError::PeerGone {
                engine_id: format!("slot {}", slot.0),
                reason: "peer removed".into(),
            }));
            return;
        };
        let limits = self.ep.limits;
        let plan = ReadPlan::new(segments, limits.max_msg_bytes, limits.iovs_per_read);
        if plan.is_empty() {
            done.complete(Ok(()));
            return;
        }
        let read_id = self.next_read.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().insert(
            read_id,
            Pending {
                remaining: plan.len(),
                error: None,
                done: Some(done),
            },
        );
        let total = plan.len();
        for (gi, g) in plan.groups().enumerate() {
            if let Err(err) = self.post_group(slot, peer, read_id, g) {
                // Account for this and every group not posted.
                self.finish_ops(read_id, total - gi, Some(err));
                break;
            }
        }
        self.wake();
    }

    /// The IOVs of one group, local ones into our registrations.
    fn iovs(&self, peer: &PeerEntry, group: &[Chunk]) -> Iovs {
        let mut v = Iovs {
            local: Vec::with_capacity(group.len()),
            descs: Vec::with_capacity(group.len()),
            rma: Vec::with_capacity(group.len()),
        };
        for c in group {
            let mr = &self.mrs[c.region as usize];
            let rr = peer.regions[c.region as usize];
            v.local.push(sys::iovec {
                iov_base: (mr.addr + c.local_offset) as *mut c_void,
                iov_len: c.len as usize,
            });
            v.descs.push(mr.desc);
            v.rma.push(sys::fi_rma_iov {
                addr: rr.base_addr + c.remote_offset,
                len: c.len as usize,
                key: rr.key,
            });
        }
        v
    }

    /// Posts one group as one operation of READ `read_id`.
    ///
    /// # Errors
    /// [`DataplaneError::PeerGone`] when the peer was removed meanwhile,
    /// [`DataplaneError::Backend`] when `fi_readmsg` failed (or kept
    /// answering `-FI_EAGAIN` for [`POST_WINDOW`]).
    fn post_group(
        &self,
        slot: PeerSlot,
        peer: &PeerEntry,
        read_id: u64,
        group: &[Chunk],
    ) -> Result<(), DataplaneError> {
        let mut iovs = self.iovs(peer, group);
        let ctx = Box::into_raw(Box::new(OpCtx {
            // SAFETY: fi_context2 is plain provider scratch space; all-zero is valid.
            ctx: unsafe { std::mem::zeroed() },
            read_id,
        }));
        // Respect the provider's queue depth (bounded like the EAGAIN
        // retries below; a peer being removed stops the wait).
        let deadline = Instant::now() + POST_WINDOW;
        let limits = self.ep.limits;
        while self.outstanding.load(Ordering::Acquire) >= limits.tx_size
            && Instant::now() < deadline
            && !peer.gone.load(Ordering::Acquire)
        {
            self.wake();
            std::thread::yield_now();
        }
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        let ret = loop {
            // SAFETY: the local IOVs point into our registrations, which live
            // as long as `self`; `ctx` is reclaimed when its completion is read
            // (or below, when the post fails).
            let r = unsafe {
                self.ep.post(
                    peer.fi_addr,
                    &iovs.local,
                    &mut iovs.descs,
                    &iovs.rma,
                    ctx as *mut c_void,
                )
            };
            if r == -(sys::FI_EAGAIN as isize)
                && Instant::now() < deadline
                && !peer.gone.load(Ordering::Acquire)
            {
                self.wake();
                std::thread::yield_now();
                continue;
            }
            break r;
        };
        if ret == 0 {
            return Ok(());
        }
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
        // SAFETY: not posted, so the provider never saw `ctx`: reclaim it once.
        drop(unsafe { Box::from_raw(ctx) });
        Err(if peer.gone.load(Ordering::Acquire) {
            DataplaneError::PeerGone {
                engine_id: format!("slot {}", slot.0),
                reason: "peer disconnected while the READ was being posted".into(),
            }
        } else {
            DataplaneError::Backend {
                backend: self.ep.name(),
                op: "fi_readmsg",
                code: ret as i64,
                message: fi_error_string(ret as i64),
            }
        })
    }
}
