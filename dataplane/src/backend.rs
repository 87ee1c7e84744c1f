//! The interface every transfer backend implements (libfabric, NIXL), and the
//! metadata engines exchange about their backends at handshake.
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::error::{DataplaneError, Result};
use crate::layout::Segment;
use crate::quarantine::Release;

/// What a peer needs to know about one of an engine's registered regions to
/// READ from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteRegion {
    /// Address the READ must name for offset 0 of the region: the virtual
    /// address when the provider uses `FI_MR_VIRT_ADDR` (and for NIXL), else 0.
    pub base_addr: u64,
    /// Remote memory key (`fi_mr_key`); 0 for NIXL, which carries keys in its
    /// own metadata blob.
    pub key: u64,
    /// Region length in bytes.
    pub len_bytes: u64,
    /// Device ordinal for device memory (NIXL `devId`); 0 for host memory.
    pub device_id: u64,
}

/// Backend description sent at handshake, versioned with the side channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendMetadata {
    /// libfabric used directly.
    Libfabric {
        /// Provider name as libfabric reports it, e.g. `tcp;ofi_rxm`, `shm`, `efa`.
        provider: String,
        /// Endpoint address (`fi_getname`), inserted into the reader's AV.
        address: Vec<u8>,
        /// Registered regions, in layout order.
        regions: Vec<RemoteRegion>,
    },
    /// NIXL agent.
    Nixl {
        /// NIXL backend plugin, e.g. `UCX`, `LIBFABRIC`.
        plugin: String,
        /// The NIXL agent name (unique per engine).
        agent_name: String,
        /// `getLocalMD()` blob, loaded with `loadRemoteMD()` by the reader.
        metadata: Vec<u8>,
        /// Registered regions, in layout order.
        regions: Vec<RemoteRegion>,
    },
}

impl BackendMetadata {
    /// Regions of the remote engine, in layout order.
    pub fn regions(&self) -> &[RemoteRegion] {
        match self {
            Self::Libfabric { regions, .. } | Self::Nixl { regions, .. } => regions,
        }
    }

    /// Short description, e.g. `libfabric/tcp;ofi_rxm` or `nixl/UCX`.
    pub fn describe(&self) -> String {
        match self {
            Self::Libfabric { provider, .. } => format!("libfabric/{provider}"),
            Self::Nixl { plugin, .. } => format!("nixl/{plugin}"),
        }
    }
}

/// Completion handle of one posted READ: resolved exactly once by the
/// backend, after every operation it posted for that READ has completed
/// (successfully or not). Never resolved while an operation may still write
/// local memory. Dropped unresolved, it counts as completed without a result.
pub struct Completion {
    tx: Option<oneshot::Sender<Result<()>>>,
    release: Option<Release>,
}

impl Completion {
    /// A completion and the receiver that resolves with it.
    pub fn new() -> (Self, oneshot::Receiver<Result<()>>) {
        let (tx, rx) = oneshot::channel();
        (
            Self {
                tx: Some(tx),
                release: None,
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
/// polling the completion queue) so that they also serve remote READs.
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
