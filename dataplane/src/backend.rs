//! The interface every transfer backend implements (libfabric, NIXL), and the
//! metadata engines exchange about their backends at handshake.
use tokio::sync::oneshot;

use crate::error::{DataplaneError, Result};
use crate::layout::Segment;
use crate::quarantine::Release;

/// Defined with the side-channel messages in `kvloop-kv-types`.
pub use kvloop_kv_types::sidechannel::{BackendMetadata, RailEndpoint, RemoteRegion};

/// Completion handle of one posted READ: resolved exactly once by the
/// backend, after every operation it posted for that READ has completed
/// (successfully or not). Never resolved while an operation may still write
/// local memory. Dropped unresolved, it counts as completed without a result.
pub struct Completion {
    tx: Option<oneshot::Sender<Result<()>>>,
    release: Option<Release>,
    progress: Option<std::sync::Arc<ReadProgress>>,
}

/// How far a READ in flight has come: bytes of its operations that
/// completed so far, counted by backends that complete a READ in several
/// operations (libfabric: one per group of descriptors); NIXL reports a
/// transfer only whole, so its count stays 0 until the end. Shared between
/// the backend and whoever watches the READ (the agent's progress-aware
/// abandon, `kvloop_router_api::abandon::abandon_on_progress`).
#[derive(Debug, Default)]
pub struct ReadProgress {
    done_bytes: std::sync::atomic::AtomicU64,
}

impl ReadProgress {
    /// Bytes completed so far.
    pub fn done_bytes(&self) -> u64 {
        self.done_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts `bytes` more as completed.
    pub fn add(&self, bytes: u64) {
        self.done_bytes
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Completion {
    /// A completion and the receiver that resolves with it.
    pub fn new() -> (Self, oneshot::Receiver<Result<()>>) {
        let (tx, rx) = oneshot::channel();
        (
            Self {
                tx: Some(tx),
                release: None,
                progress: None,
            },
            rx,
        )
    }

    /// A completion that also takes its READ out of the engine's quarantine
    /// (before the result is sent).
    pub(crate) fn with_release(tx: oneshot::Sender<Result<()>>, release: Release) -> Self {
        Self {
            tx: Some(tx),
            release: Some(release),
            progress: None,
        }
    }

    /// This completion, counting its READ's completed bytes into `progress`.
    pub fn with_progress(mut self, progress: Option<std::sync::Arc<ReadProgress>>) -> Self {
        self.progress = progress;
        self
    }

    /// Counts `bytes` of the READ as completed (backends that complete a
    /// READ in several operations call it per operation or run of them).
    pub fn progressed(&self, bytes: u64) {
        if let Some(p) = &self.progress {
            p.add(bytes);
        }
    }

    /// Resolves the READ.
    pub fn complete(mut self, r: Result<()>) {
        self.finish(Some(r));
    }

    fn finish(&mut self, r: Option<Result<()>>) {
        let Some(tx) = self.tx.take() else { return };
        match self.release.take() {
            Some(rel) => rel.finish(tx, r),
            None => {
                if let Some(r) = r {
                    let _ = tx.send(r);
                }
            }
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        self.finish(None);
    }
}

/// Opaque index of a peer inside a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerSlot(pub usize);

/// A transfer backend. Implementations make their own progress (a thread
/// polling the completion queue) so that they also serve remote READs; a
/// caller awaiting a READ may drive completions itself for a while
/// ([`TransferBackend::caller_spin`]), which saves two thread handoffs.
pub trait TransferBackend: Send + Sync + 'static {
    /// Human-readable name, e.g. `libfabric tcp;ofi_rxm`.
    fn name(&self) -> String;
    /// Which kind, for probes and metrics.
    fn kind(&self) -> kvloop_common::BackendKind;
    /// What peers need to READ from this engine.
    fn metadata(&self) -> BackendMetadata;
    /// Refuses a peer whose backend cannot talk to this one.
    ///
    /// # Errors
    /// [`DataplaneError::LayoutMismatch`] naming the field (`backend`, `provider`, `plugin`).
    fn check_peer(&self, engine_id: &str, peer: &BackendMetadata) -> Result<()>;
    /// Makes a peer readable (AV insert, load remote metadata).
    fn add_peer(&self, engine_id: &str, peer: &BackendMetadata) -> Result<PeerSlot>;
    /// Forgets a peer.
    fn remove_peer(&self, slot: PeerSlot);
    /// Posts the READ of `segments` from `peer` into local regions; resolves
    /// `done` when every operation completed. Segments were bounds-checked by
    /// the engine.
    ///
    /// # Errors
    /// Posting failures are delivered through `done`, after operations already
    /// posted have completed.
    fn post_read(&self, peer: PeerSlot, segments: &[Segment], done: Completion);
    /// Waits up to `timeout` for every posted operation to complete, still
    /// making progress. Returns `false` when operations are still in flight:
    /// the caller must then not free the registered memory (it leaks it
    /// rather than let the provider write into unmapped pages).
    fn quiesce(&self, timeout: std::time::Duration) -> bool;
    /// How long the task awaiting a READ may drive completions itself
    /// ([`TransferBackend::drive`]) before leaving them to the backend's own
    /// progress. Default zero: the backend makes all its own progress (NIXL).
    fn caller_spin(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
    /// Takes the caller-driver role: `true` when this caller is now the one
    /// that polls completions ([`TransferBackend::drive`]) until it calls
    /// [`TransferBackend::drive_end`]; `false` when another caller holds it
    /// (that caller, or the backend's progress after it, completes this
    /// caller's READ too) or the backend has no caller-driven progress.
    /// One driver at a time keeps the other awaiting tasks parked instead of
    /// spinning on every runtime worker. Default: `false`.
    fn drive_begin(&self) -> bool {
        false
    }
    /// Polls for completions once on the driver's thread (resolving any
    /// READ that completed, not only the driver's). Cheap and non-blocking;
    /// only the holder of the role calls it. Default: nothing.
    fn drive(&self) {}
    /// Gives the role up; when anything is still in flight the backend's own
    /// progress takes over at once. Default: nothing.
    fn drive_end(&self) {}
    /// Payload bytes each rail has carried (successful READ operations
    /// since the backend started), first rail first; empty for backends
    /// without rails (NIXL). Default: empty.
    fn rail_bytes(&self) -> Vec<u64> {
        Vec::new()
    }
    /// A peer is about to READ this engine's memory for about `expected`:
    /// keep serving-side progress active that long. Default: nothing (NIXL's
    /// UCX backend makes its own progress).
    fn kick(&self, expected: std::time::Duration) {
        let _ = expected;
    }
}

pub(crate) fn mismatch(
    engine_id: &str,
    field: &'static str,
    local: String,
    remote: String,
) -> DataplaneError {
    DataplaneError::LayoutMismatch {
        engine_id: engine_id.into(),
        field,
        local,
        remote,
    }
}
