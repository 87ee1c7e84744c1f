//! Quarantine of destination blocks whose READ was abandoned by its caller
//! (timed out, or its future dropped) while the backend may still write them.
//!
//! [`Quarantine`] is the pure bookkeeping; [`PendingRead`] is the drop guard
//! held by [`crate::TransferEngine::read`] while it waits, and
//! [`Release`] is carried by the READ's [`crate::backend::Completion`] so that
//! the blocks leave quarantine exactly when the backend is done with them.
//! Both take the same lock, and the completion is sent while it is held, so
//! an abandon and a completion racing each other resolve one way or the other,
//! never leaving blocks quarantined forever or unprotected.
use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::error::Result;

/// Blocks of abandoned READs that have not completed. Pure: no I/O, no time.
#[derive(Debug, Default)]
pub(crate) struct Quarantine {
    /// Abandoned READ id → its local (destination) block ids.
    abandoned: HashMap<u64, Vec<u64>>,
    /// Local block id → number of abandoned, uncompleted READs writing it.
    blocks: HashMap<u64, u32>,
}

impl Quarantine {
    /// The first of `locals` that is quarantined, if any.
    pub(crate) fn first_quarantined(&self, mut locals: impl Iterator<Item = u64>) -> Option<u64> {
        if self.blocks.is_empty() {
            return None;
        }
        locals.find(|b| self.blocks.contains_key(b))
    }

    /// READ `xfer_id` into `locals` was abandoned before it completed.
    /// Abandoning the same READ twice counts once.
    pub(crate) fn abandon(&mut self, xfer_id: u64, locals: Vec<u64>) {
        if self.abandoned.contains_key(&xfer_id) {
            return;
        }
        for b in &locals {
            *self.blocks.entry(*b).or_insert(0) += 1;
        }
        self.abandoned.insert(xfer_id, locals);
    }

    /// READ `xfer_id` completed: the backend no longer writes its blocks.
    /// A no-op for a READ that was not abandoned.
    pub(crate) fn complete(&mut self, xfer_id: u64) {
        let Some(locals) = self.abandoned.remove(&xfer_id) else {
            return;
        };
        for b in locals {
            if let Some(c) = self.blocks.get_mut(&b) {
                *c -= 1;
                if *c == 0 {
                    self.blocks.remove(&b);
                }
            }
        }
    }

    /// Quarantined local block ids, ascending.
    pub(crate) fn blocks(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.blocks.keys().copied().collect();
        v.sort_unstable();
        v
    }
}

/// Shared quarantine of one engine.
pub(crate) type SharedQuarantine = Arc<Mutex<Quarantine>>;

/// Carried by a READ's completion: marks the READ complete in the quarantine,
/// under its lock, before the result is sent.
pub(crate) struct Release {
    table: Weak<Mutex<Quarantine>>,
    xfer_id: u64,
}

impl Release {
    /// Marks the READ complete, then sends `r` (if any) on `tx`, both under
    /// the quarantine's lock.
    pub(crate) fn finish(self, tx: oneshot::Sender<Result<()>>, r: Option<Result<()>>) {
        let Some(table) = self.table.upgrade() else {
            if let Some(r) = r {
                let _ = tx.send(r);
            }
            return;
        };
        let mut q = table.lock();
        q.complete(self.xfer_id);
        match r {
            Some(r) => {
                let _ = tx.send(r);
            }
            None => drop(tx),
        }
        drop(q);
    }
}

/// The caller's side of a posted READ. Dropped before the result arrived
/// (timeout, or the caller's future dropped), it quarantines the READ's
/// destination blocks until the backend completes it.
pub(crate) struct PendingRead {
    table: SharedQuarantine,
    xfer_id: u64,
    locals: Vec<u64>,
    /// The completion's receiver; `None` once the result was taken.
    pub(crate) rx: Option<oneshot::Receiver<Result<()>>>,
}

impl PendingRead {
    /// A guard for READ `xfer_id` into `locals`, and the [`Release`] its
    /// completion must carry.
    pub(crate) fn new(
        table: &SharedQuarantine,
        xfer_id: u64,
        locals: Vec<u64>,
        rx: oneshot::Receiver<Result<()>>,
    ) -> (Self, Release) {
        (
            Self {
                table: table.clone(),
                xfer_id,
                locals,
                rx: Some(rx),
            },
            Release {
                table: Arc::downgrade(table),
                xfer_id,
            },
        )
    }
}

impl Drop for PendingRead {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let mut q = self.table.lock();
        // The completion is sent under this lock: `Empty` here means it has
        // not happened yet and will find the READ abandoned when it does.
        if let Err(oneshot::error::TryRecvError::Empty) = rx.try_recv() {
            q.abandon(self.xfer_id, std::mem::take(&mut self.locals));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abandoned_blocks_stay_quarantined_until_completion() {
        let mut q = Quarantine::default();
        assert_eq!(q.first_quarantined([1, 2].into_iter()), None);
        q.abandon(7, vec![1, 2]);
        q.abandon(8, vec![2, 3]);
        q.abandon(8, vec![2, 3]);
        assert_eq!(q.blocks(), vec![1, 2, 3]);
        assert_eq!(q.first_quarantined([5, 3, 1].into_iter()), Some(3));
        q.complete(7);
        assert_eq!(q.blocks(), vec![2, 3]);
        q.complete(7);
        q.complete(99);
        assert_eq!(q.blocks(), vec![2, 3]);
        q.complete(8);
        assert!(q.blocks().is_empty());
        assert_eq!(q.first_quarantined([2].into_iter()), None);
    }

    #[test]
    fn dropped_guard_quarantines_until_release() {
        let table: SharedQuarantine = Arc::default();
        let (tx, rx) = oneshot::channel();
        let (guard, release) = PendingRead::new(&table, 1, vec![4, 5], rx);
        drop(guard);
        assert_eq!(table.lock().blocks(), vec![4, 5]);
        release.finish(tx, Some(Ok(())));
        assert!(table.lock().blocks().is_empty());
    }

    #[test]
    fn guard_dropped_after_completion_quarantines_nothing() {
        let table: SharedQuarantine = Arc::default();
        let (tx, rx) = oneshot::channel();
        let (guard, release) = PendingRead::new(&table, 1, vec![4], rx);
        release.finish(tx, Some(Ok(())));
        drop(guard);
        assert!(table.lock().blocks().is_empty());
        // A completion dropped without a result counts as completed too.
        let (tx, rx) = oneshot::channel();
        let (guard, release) = PendingRead::new(&table, 2, vec![4], rx);
        release.finish(tx, None);
        drop(guard);
        assert!(table.lock().blocks().is_empty());
    }
}
