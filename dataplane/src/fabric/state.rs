//! State shared by the libfabric backend and its progress thread: the
//! endpoint and registrations, the peer table, and the READs in flight.
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};

use super::config::{FabricConfig, Limits};
use super::ffi::{Endpoint, Mr, sys};
use super::plan::ReadPlan;
use crate::backend::{Completion, PeerSlot, RemoteRegion};
use crate::error::DataplaneError;

/// Per-operation context handed to libfabric. `ctx` comes first so that the
/// provider's `FI_CONTEXT`/`FI_CONTEXT2` scratch space is the struct's start.
#[repr(C)]
pub(crate) struct OpCtx {
    /// Provider scratch space.
    pub(crate) ctx: sys::fi_context2,
    /// The READ this operation belongs to.
    pub(crate) read_id: u64,
    /// Payload bytes of this operation (counted on its rail when it
    /// completes successfully).
    pub(crate) bytes: u64,
}

/// A READ whose operations are not all finished.
pub(crate) struct Pending {
    /// Operations not finished yet.
    pub(crate) remaining: usize,
    /// The first error seen.
    pub(crate) error: Option<DataplaneError>,
    /// Resolved when `remaining` reaches 0.
    pub(crate) done: Option<Completion>,
}

/// A READ whose groups are not all posted yet: it waits in [`Backlog`] for
/// room in the provider's queue (or for `-FI_EAGAIN` to clear).
pub(crate) struct Queued {
    /// The peer it reads from.
    pub(crate) slot: PeerSlot,
    /// The rail its groups are posted on (index into [`Shared::rails`]).
    pub(crate) rail: usize,
    /// The READ its groups belong to.
    pub(crate) read_id: u64,
    /// Its `fi_readmsg` calls on `rail` (the READ's part on that rail).
    pub(crate) plan: ReadPlan,
    /// The first group not posted yet.
    pub(crate) next: usize,
    /// Since when it has been at the front without posting anything.
    pub(crate) stalled_since: Option<Instant>,
}

/// READs waiting to be posted, oldest first, and the IOV arrays reused by
/// every post (they are only touched under the backlog's lock).
pub(crate) struct Backlog {
    pub(crate) queue: VecDeque<Queued>,
    pub(crate) local: Vec<sys::iovec>,
    pub(crate) descs: Vec<*mut c_void>,
    pub(crate) rma: Vec<sys::fi_rma_iov>,
}

// SAFETY: the raw pointers in the IOV arrays point into this backend's own
// registrations and are only read or written under the `Mutex` that holds
// the backlog; nothing else aliases them.
unsafe impl Send for Backlog {}

/// What one local rail reads of a peer: the peer's rail it pairs with.
pub(crate) struct PeerRail {
    /// The peer rail's address in this rail's AV.
    pub(crate) fi_addr: u64,
    /// The peer's regions as registered on that rail, in layout order.
    pub(crate) regions: Vec<RemoteRegion>,
}

/// A peer inserted into the AVs.
pub(crate) struct PeerEntry {
    /// By local rail: local rail `k` reads the peer's rail `k mod n`.
    pub(crate) rails: Vec<PeerRail>,
    /// Set when the peer is being removed: a READ retrying `-FI_EAGAIN` on
    /// it (a dead connection never drains) gives up instead of holding the
    /// peer table for the whole retry window.
    pub(crate) gone: AtomicBool,
}

/// One rail: an endpoint and every region registered on its domain.
pub(crate) struct Rail {
    // Field order is drop order: registrations close before the endpoint.
    pub(crate) mrs: Vec<Mr>,
    pub(crate) ep: Endpoint,
    /// Operations posted on this rail and not completed (at most
    /// `tx_size`).
    pub(crate) outstanding: AtomicUsize,
    /// Payload bytes of this rail's successfully completed operations since
    /// the backend started.
    pub(crate) bytes: AtomicU64,
}

/// State shared by the backend handle and its progress thread.
pub(crate) struct Shared {
    /// The endpoints, first rail first (one when no rails are configured).
    pub(crate) rails: Vec<Rail>,
    /// Limits in force for planning: the smallest of every rail's.
    pub(crate) limits: Limits,
    /// Peers by slot. READs are posted under the read lock, so a peer is
    /// never removed while one of its READs is being posted.
    pub(crate) peers: RwLock<Vec<Option<PeerEntry>>>,
    /// (rail, AV entry) of removed peers, handed to `fi_av_remove` only once no
    /// operation is outstanding: removing an address under in-flight READs
    /// to it crashes inside tcp;ofi_rxm (seen on libfabric 1.17 when a peer
    /// agent exited while this one was probing it).
    pub(crate) retired: Mutex<Vec<(usize, u64)>>,
    /// `retired` is not empty (checked by the progress loop without locking).
    pub(crate) retired_any: AtomicBool,
    pub(crate) pending: Mutex<HashMap<u64, Pending>>,
    /// READs not fully posted (see [`Queued`]); posting never waits for room.
    pub(crate) backlog: Mutex<Backlog>,
    /// Entries in `backlog` (read without its lock).
    pub(crate) queued: AtomicUsize,
    /// Set while one caller polls the completion queue ([`Shared::drive`]).
    pub(crate) driving: AtomicBool,
    /// ns after `epoch` of the last caller-driven poll; 0 when no caller
    /// drives. The progress thread stays off the CQ while callers drive.
    pub(crate) last_drive_ns: AtomicU64,
    /// Operations posted and not completed, every rail together.
    pub(crate) outstanding: AtomicUsize,
    pub(crate) next_read: AtomicU64,
    pub(crate) stop: AtomicBool,
    /// eventfd that posters write to wake a progress thread blocked in poll(2).
    pub(crate) waker: i32,
    /// Spin (serve) until this many ns after `epoch`: set by [`TransferBackend::kick`].
    pub(crate) serve_until_ns: AtomicU64,
    pub(crate) epoch: Instant,
    pub(crate) cfg: FabricConfig,
}

impl Shared {
    /// The first rail's endpoint (provider name, error messages).
    pub(crate) fn ep(&self) -> &Endpoint {
        &self.rails[0].ep
    }

    /// Accounts `ops` operations of READ `read_id` as finished (completed, or
    /// never posted), `bytes` of them completed without error (counted into
    /// the READ's [`crate::backend::ReadProgress`]), keeping the first
    /// error; resolves the READ when none remain.
    pub(crate) fn finish_ops(
        &self,
        read_id: u64,
        (ops, bytes): (usize, u64),
        err: Option<DataplaneError>,
    ) {
        let mut pending = self.pending.lock();
        let Some(p) = pending.get_mut(&read_id) else {
            return;
        };
        if p.error.is_none() {
            p.error = err;
        }
        if let Some(done) = &p.done {
            done.progressed(bytes);
        }
        p.remaining -= ops;
        if p.remaining == 0 {
            let p = pending.remove(&read_id).unwrap();
            drop(pending);
            if let Some(done) = p.done {
                done.complete(match p.error {
                    Some(e) => Err(e),
                    None => Ok(()),
                });
            }
        }
    }

    /// Removes retired AV entries if nothing is outstanding.
    pub(crate) fn reap_retired(&self) {
        if self.outstanding.load(Ordering::Acquire) > 0 {
            return;
        }
        let mut r = self.retired.lock();
        // Re-check under the lock: a READ to a retired address cannot be
        // posted any more (its slot is gone), so `outstanding` reaching 0
        // means the retired addresses carry nothing in flight.
        if self.outstanding.load(Ordering::Acquire) == 0 {
            for (rail, fi_addr) in r.drain(..) {
                self.rails[rail].ep.remove_peer(fi_addr);
            }
            self.retired_any.store(false, Ordering::Release);
        }
    }

    /// Wakes the progress thread (waiting in ppoll(2) or poll(2) on `waker`).
    pub(crate) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: `waker` is our open eventfd; writing 8 bytes from a live u64.
        unsafe { libc::write(self.waker, &one as *const u64 as *const c_void, 8) };
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: `waker` is our eventfd, closed once, here.
        unsafe { libc::close(self.waker) };
    }
}
