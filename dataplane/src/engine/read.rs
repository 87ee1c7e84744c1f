//! READ requests and their outcome, the bounds checks done before anything
//! is posted, and [`TransferEngine::read`].
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvloop_common::{ReadProbeArgs, status};

use super::TransferEngine;
use tokio::sync::mpsc;

use crate::backend::{Completion, PeerSlot};
use crate::error::{DataplaneError, Result, Side};
use crate::layout::{BlockPair, KvLayout, Segment, segments};
use crate::notify::format_notification;
use crate::quarantine::PendingRead;
use crate::sidechannel::Message;

pub use kvloop_kv_types::request::{OwnerNotify, ReadOutcome, ReadRequest};

impl TransferEngine {
    /// Reads `req.blocks` from `req.peer_engine_id` into local blocks.
    ///
    /// Every block id is checked against both layouts, and the peer must be
    /// known, before anything is posted. The future resolves when every
    /// operation completed, or with [`DataplaneError::Timeout`] after the
    /// timeout; the local destination blocks of a timed-out READ stay
    /// quarantined (refused as destinations) until the backend reports the
    /// abandoned operations complete, so late data never lands in blocks that
    /// were handed out again. On success, the owner is notified if asked.
    ///
    /// # Errors
    /// [`DataplaneError::UnknownPeer`], [`DataplaneError::BlockOutOfRange`],
    /// [`DataplaneError::DuplicateLocalBlock`], [`DataplaneError::BlockQuarantined`],
    /// [`DataplaneError::Config`] (empty `blocks`), [`DataplaneError::Timeout`],
    /// [`DataplaneError::Backend`], [`DataplaneError::PeerGone`].
    pub async fn read(&self, req: &ReadRequest) -> Result<ReadOutcome> {
        self.read_with_progress(req, None).await
    }

    /// [`TransferEngine::read`], counting the bytes of its operations that
    /// complete into `progress` while it runs (libfabric backends; NIXL
    /// reports a transfer only whole). Dropping this future abandons the
    /// READ as its timeout does: its operations still run to their end in
    /// the backend (posted ones cannot be cancelled, and queued ones are
    /// still posted), and its destination blocks stay quarantined until
    /// then.
    ///
    /// # Errors
    /// As [`TransferEngine::read`].
    pub async fn read_with_progress(
        &self,
        req: &ReadRequest,
        progress: Option<std::sync::Arc<crate::backend::ReadProgress>>,
    ) -> Result<ReadOutcome> {
        let inner = &self.inner;
        let t = self.target(req)?;
        let local_layout = inner.cfg.layout;
        let segs = segments(&local_layout, &req.blocks);
        let bytes = req.blocks.len() as u64 * local_layout.bytes_per_block_id();
        let descriptors =
            (req.blocks.len() as u64 * local_layout.num_regions as u64).min(u32::MAX as u64) as u32;
        let xfer_id = inner.next_xfer.fetch_add(1, Ordering::Relaxed);
        let mut probe = ReadProbeArgs {
            xfer_id,
            bytes,
            descriptors,
            direction: req.direction as u8,
            backend: inner.backend.kind() as u8,
            status: status::OK,
            peer: ReadProbeArgs::peer_from_str(&req.peer_engine_id),
            weight: 1,
            _pad: [0; 4],
        };
        // Small READs are probed one in N, standing for N (the sites cost
        // about 1.5 µs of CPU per probed READ).
        let probed = kvloop_common::usdt::site_weight(bytes);
        if let Some(w) = probed {
            probe.weight = w;
        }
        let timeout_ms = req.timeout_ms.unwrap_or(inner.cfg.read_timeout_ms);
        let start = Instant::now();
        if probed.is_some() {
            kvloop_common::usdt::read_post(&probe);
        }
        // Wake the owner's serving-side progress for about the READ's duration
        // (estimated at 1 GB/s, a low rate for the paths kvloop runs on),
        // unless an earlier hint's window still covers it.
        if let Some(hint_bytes) = t.hint_bytes {
            let _ = t.peer_tx.send(Message::ReadHint { bytes: hint_bytes });
        }
        let locals: Vec<u64> = req.blocks.iter().map(|b| b.local).collect();
        let result = match self
            .post_and_wait(t.slot, &segs, (xfer_id, progress), locals, timeout_ms)
            .await
        {
            Some(r) => r,
            None => Err(DataplaneError::Timeout {
                xfer_id,
                engine_id: req.peer_engine_id.clone(),
                timeout_ms,
            }),
        };
        let elapsed = start.elapsed();
        probe.status = probe_status(&result);
        if probed.is_some() {
            kvloop_common::usdt::read_done(&probe);
        }
        result?;
        if let Some(n) = &req.notify {
            let notif = format_notification(&n.owner_request_id, n.count);
            if t.peer_tx.send(Message::Notify { notif }).is_err() {
                tracing::warn!(peer = %req.peer_engine_id, "owner notification not sent: side channel closed");
            }
        }
        Ok(ReadOutcome {
            xfer_id,
            bytes,
            descriptors,
            elapsed_us: elapsed.as_micros() as u64,
        })
    }

    /// The peer of `req`, after checking its blocks against both layouts and
    /// the quarantine.
    fn target(&self, req: &ReadRequest) -> Result<Target> {
        let inner = &self.inner;
        let (t, remote_layout) = {
            let peers = inner.peers.read();
            let p = peers
                .get(&req.peer_engine_id)
                .ok_or_else(|| DataplaneError::UnknownPeer {
                    engine_id: req.peer_engine_id.clone(),
                })?;
            let hint_bytes = needs_serving_progress(&p.metadata.backend)
                .then(|| {
                    let bytes = req.blocks.len() as u64 * inner.cfg.layout.bytes_per_block_id();
                    let now_ns = inner.epoch.elapsed().as_nanos() as u64;
                    hint_window(&p.hint_until_ns, now_ns, bytes)
                })
                .flatten();
            let t = Target {
                slot: p.slot,
                peer_tx: p.tx.clone(),
                hint_bytes,
            };
            (t, p.metadata.layout)
        };
        validate_pairs(&inner.cfg.layout, &remote_layout, &req.blocks)?;
        if let Some(block_id) = inner
            .quarantine
            .lock()
            .first_quarantined(req.blocks.iter().map(|b| b.local))
        {
            return Err(DataplaneError::BlockQuarantined { block_id });
        }
        Ok(t)
    }

    /// Posts the READ and waits up to `timeout_ms` for its completion;
    /// `None` when the time ran out. Dropped before the result arrives
    /// (timeout, or this future dropped by its caller), the guard
    /// quarantines the destination blocks `locals` until the backend
    /// completes the READ.
    async fn post_and_wait(
        &self,
        slot: PeerSlot,
        segs: &[Segment],
        (xfer_id, progress): (u64, Option<std::sync::Arc<crate::backend::ReadProgress>>),
        locals: Vec<u64>,
        timeout_ms: u64,
    ) -> Option<Result<()>> {
        let inner = &self.inner;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (mut pending, release) = PendingRead::new(&inner.quarantine, xfer_id, locals, rx);
        inner.backend.post_read(
            slot,
            segs,
            Completion::with_release(tx, release).with_progress(progress),
        );
        let rx = pending
            .rx
            .as_mut()
            .expect("receiver taken only by the guard");
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        let r = driven_wait(&**inner.backend, rx, deadline, &inner.reads_waiting).await?;
        pending.rx = None;
        Some(r.unwrap_or(Err(DataplaneError::Shutdown)))
    }
}

/// How long a driving caller whose READ is the engine's only one polls
/// between yields to the runtime. With other READs waiting it yields after
/// every poll, so that their tasks run as soon as their results arrive.
const POLL_BEFORE_YIELD: Duration = Duration::from_micros(20);

/// Waits until `deadline` for a READ's result (`None` when it passed),
/// first driving the backend's completions on this task (yielding to other
/// tasks between polls) for up to [`TransferBackend::caller_spin`] when no
/// other task drives them, then leaving them to the backend's own progress.
/// A READ that completes while its caller drives costs no timer. Cancel-safe:
/// dropped while driving, it gives the role up and the backend's progress
/// completes the READ (and releases its quarantined blocks).
///
/// [`TransferBackend::caller_spin`]: crate::backend::TransferBackend::caller_spin
async fn driven_wait(
    backend: &dyn crate::backend::TransferBackend,
    rx: &mut tokio::sync::oneshot::Receiver<Result<()>>,
    deadline: tokio::time::Instant,
    reads_waiting: &std::sync::atomic::AtomicUsize,
) -> Option<std::result::Result<Result<()>, tokio::sync::oneshot::error::RecvError>> {
    use tokio::sync::oneshot::error::TryRecvError;
    /// Counts this READ as waiting while the future lives.
    struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    reads_waiting.fetch_add(1, Ordering::Relaxed);
    let _waiting = Waiting(reads_waiting);
    /// Gives the driver role up however the spin ends.
    struct DriveEnd<'a>(&'a dyn crate::backend::TransferBackend);
    impl Drop for DriveEnd<'_> {
        fn drop(&mut self) {
            self.0.drive_end();
        }
    }
    let spin = backend.caller_spin();
    if !spin.is_zero() && backend.drive_begin() {
        let _end = DriveEnd(backend);
        let until = Instant::now() + spin;
        'spin: loop {
            // Alone, poll for up to POLL_BEFORE_YIELD before yielding: a
            // yield makes the multi-threaded runtime wake a parked worker (a
            // futex call and a thread that finds nothing to do), which costs
            // more than a short READ (measured: tcp 4 KiB READs 25 → 17 µs
            // of CPU each).
            let alone = reads_waiting.load(Ordering::Relaxed) <= 1;
            let slice = Instant::now()
                + if alone {
                    POLL_BEFORE_YIELD
                } else {
                    Duration::ZERO
                };
            loop {
                backend.drive();
                match rx.try_recv() {
                    Ok(r) => return Some(Ok(r)),
                    Err(TryRecvError::Closed) => break 'spin,
                    Err(TryRecvError::Empty) => {}
                }
                let now = Instant::now();
                if now >= until || tokio::time::Instant::now() >= deadline {
                    break 'spin;
                }
                if now >= slice {
                    break;
                }
            }
            tokio::task::yield_now().await;
        }
    }
    tokio::time::timeout_at(deadline, rx).await.ok()
}

/// The peer a READ goes to.
struct Target {
    slot: PeerSlot,
    peer_tx: mpsc::UnboundedSender<Message>,
    /// The [`Message::ReadHint`] to send first, if any.
    hint_bytes: Option<u64>,
}

/// Shortest serving window a hint asks for: 1 ms at the hint's 1 GB/s
/// (10^6 bytes). Back-to-back small READs then send one hint per ms, not one
/// each (a side-channel write and a wake-up of the owner's task per READ
/// cost both processes CPU and put a tail on small READs).
const MIN_HINT_BYTES: u64 = 1_000_000;

/// Longest window one hint buys: the owner caps a hint at 1 s
/// (`FabricBackend::kick`).
const MAX_HINT_NS: u64 = 1_000_000_000;

/// Whether a READ of `bytes` at `now_ns` needs a new hint, given the window
/// the last one bought (`until_ns`, updated when a hint is due): `Some(bytes
/// to ask for)` when the window ends before the READ would (1 byte/ns).
fn hint_window(until_ns: &AtomicU64, now_ns: u64, bytes: u64) -> Option<u64> {
    let needed = now_ns + bytes.min(MAX_HINT_NS);
    if needed <= until_ns.load(Ordering::Acquire) {
        return None;
    }
    let ask = bytes.max(MIN_HINT_BYTES);
    until_ns.store(now_ns + ask.min(MAX_HINT_NS), Ordering::Release);
    Some(ask)
}

/// The probe status of a READ's result.
fn probe_status(result: &Result<()>) -> i16 {
    match result {
        Ok(()) => status::OK,
        Err(DataplaneError::Timeout { .. }) => status::TIMED_OUT,
        Err(DataplaneError::Shutdown) => status::CANCELLED,
        Err(_) => status::IO_ERROR,
    }
}

/// Whether READs from an engine with this backend need its serving side to
/// make progress (and so a [`Message::ReadHint`]): libfabric providers other
/// than `shm` (`tcp;ofi_rxm` moves data only while the target polls; EFA's
/// protocol path likewise). `shm` READs are done by the reader (CMA) and NIXL
/// runs its own progress thread.
fn needs_serving_progress(md: &crate::backend::BackendMetadata) -> bool {
    matches!(md, crate::backend::BackendMetadata::Libfabric { provider, .. } if provider != "shm")
}

/// Checks every pair against both layouts, and that no local block is written
/// twice, before anything is posted.
///
/// # Errors
/// [`DataplaneError::Config`] for an empty list, [`DataplaneError::BlockOutOfRange`]
/// naming `blocks[i].remote` / `blocks[i].local`, [`DataplaneError::DuplicateLocalBlock`].
pub fn validate_pairs(local: &KvLayout, remote: &KvLayout, pairs: &[BlockPair]) -> Result<()> {
    if pairs.is_empty() {
        return Err(DataplaneError::Config {
            field: "blocks",
            expected: "at least one (remote, local) block pair".into(),
        });
    }
    let mut seen: HashMap<u64, usize> = HashMap::with_capacity(pairs.len());
    for (i, p) in pairs.iter().enumerate() {
        remote.check_block(Side::Remote, || format!("blocks[{i}].remote"), p.remote)?;
        local.check_block(Side::Local, || format!("blocks[{i}].local"), p.local)?;
        if let Some(first) = seen.insert(p.local, i) {
            return Err(DataplaneError::DuplicateLocalBlock {
                block_id: p.local,
                first,
                second: i,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(n: u32) -> KvLayout {
        KvLayout {
            num_regions: 2,
            num_blocks: n,
            block_len_bytes: 4096,
            block_size_tokens: 16,
        }
    }

    #[test]
    fn one_hint_covers_back_to_back_small_reads() {
        let until = AtomicU64::new(0);
        // first READ: a hint of at least 1 ms
        assert_eq!(hint_window(&until, 0, 4096), Some(MIN_HINT_BYTES));
        // inside the window: none
        assert_eq!(hint_window(&until, 500_000, 4096), None);
        assert_eq!(hint_window(&until, 995_000, 4096), None);
        // one that would outlast the window: a new hint sized by the READ
        assert_eq!(hint_window(&until, 996_000, 8 << 20), Some(8 << 20));
        assert_eq!(until.load(Ordering::Relaxed), 996_000 + (8 << 20));
        // past the window: a new hint
        assert_eq!(hint_window(&until, 20_000_000, 4096), Some(MIN_HINT_BYTES));
        // a READ longer than the owner's 1 s cap buys at most 1 s
        assert_eq!(hint_window(&until, 30_000_000, 5 << 30), Some(5 << 30));
        assert_eq!(until.load(Ordering::Relaxed), 30_000_000 + MAX_HINT_NS);
    }

    #[test]
    fn pairs_are_checked_against_both_layouts() {
        let ok = [BlockPair {
            remote: 9,
            local: 3,
        }];
        validate_pairs(&l(4), &l(10), &ok).unwrap();
        let e = validate_pairs(&l(4), &l(8), &ok).unwrap_err().to_string();
        assert!(
            e.contains("blocks[0].remote") && e.contains("remote layout"),
            "{e}"
        );
        let e = validate_pairs(&l(2), &l(10), &ok).unwrap_err().to_string();
        assert!(
            e.contains("blocks[0].local") && e.contains("local layout"),
            "{e}"
        );
        let dup = [
            BlockPair {
                remote: 1,
                local: 0,
            },
            BlockPair {
                remote: 2,
                local: 0,
            },
        ];
        let e = validate_pairs(&l(4), &l(4), &dup).unwrap_err().to_string();
        assert!(e.contains("local block 0 appears twice"), "{e}");
        let e = validate_pairs(&l(4), &l(4), &[]).unwrap_err().to_string();
        assert!(e.contains("`blocks`"), "{e}");
    }
}
