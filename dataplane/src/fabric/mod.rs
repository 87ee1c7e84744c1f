//! libfabric backend: one RDM endpoint with `FI_RMA | FI_READ | FI_REMOTE_READ`
//! per rail (one per NIC in production; one without rails) on a configured
//! provider (`efa` in production; `tcp;ofi_rxm` and `shm` here), kvloop's own
//! bindings (see `build.rs`).
//!
//! Rails ([`FabricConfig::rails`]): every rail is a fabric, domain, AV, CQ
//! and endpoint of its own with every region registered on its domain; the
//! handshake metadata carries each rail's address and keys. Rail `k` of the
//! reader reads rail `k mod n` of an `n`-rail target; a READ's bytes are
//! split across the rails (`plan::split_rails`), each part is posted and
//! completed on its rail, and the READ resolves when every part has (with
//! the first error of any). Per-rail bytes: [`TransferBackend::rail_bytes`].
//!
//! * [`config`]: [`FabricConfig`] and the provider [`Limits`].
//! * `ffi`: the FFI boundary (endpoint, memory registration; the raw
//!   bindings stay crate-private). Memory registration: one path for every
//!   provider's mode bits (ask for `LOCAL|VIRT_ADDR|ALLOCATED|PROV_KEY|ENDPOINT`;
//!   always read the key back with `fi_mr_key`; remote base = VA under
//!   `FI_MR_VIRT_ADDR`, else 0; always pass `fi_mr_desc`; bind + enable under
//!   `FI_MR_ENDPOINT`).
//! * `plan`: the pure planner. Limits: outstanding operations ≤
//!   `tx_attr->size`; IOVs per READ ≤ `min(iov_limit, rma_iov_limit)`; each
//!   IOV ≤ `max_msg_size`.
//! * `post`: posting never waits; what does not fit the provider's queue
//!   stays queued and is posted as completions free room.
//! * `progress`: the task awaiting a READ polls the completion queue itself
//!   for up to `caller_spin_us` (no thread handoff per READ); otherwise a
//!   thread polls it. The thread spins while operations are outstanding or
//!   for `spin_us` after the last activity, then parks with a backoff
//!   (`idle_sleep_us` → `idle_sleep_max_us`); posting wakes it. Both the
//!   reader and the serving side need this progress (tcp moves nothing
//!   otherwise).
pub mod config;
mod ffi;
mod plan;
mod post;
mod progress;
pub mod raw;
mod state;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

pub use config::{FabricConfig, Limits};
pub use ffi::fi_error_string;

use crate::backend::{
    BackendMetadata, Completion, PeerSlot, RailEndpoint, TransferBackend, mismatch,
};
use crate::error::{DataplaneError, Result};
use crate::layout::Segment;
use crate::region::{MemoryKind, RegionDesc};
use ffi::Endpoint;
use progress::progress_loop;
use state::{PeerEntry, Shared};

/// The libfabric transfer backend.
pub struct FabricBackend {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl FabricBackend {
    /// Opens one endpoint on `cfg.provider` per rail (one bound to
    /// `cfg.bind_node` without rails), registers `regions` (in layout order)
    /// on each rail's domain and starts the progress thread.
    ///
    /// # Errors
    /// [`DataplaneError::Config`] when the provider is not available or
    /// `rails` is invalid ([`FabricConfig::rail_nodes`]);
    /// [`DataplaneError::Backend`] when a libfabric call fails.
    pub fn new(cfg: FabricConfig, regions: &[RegionDesc]) -> Result<Self> {
        let hmem = regions.iter().any(|r| r.kind != MemoryKind::Host);
        let nodes = cfg.rail_nodes()?;
        let mut rails = Vec::with_capacity(nodes.len());
        for (k, node) in nodes.iter().enumerate() {
            let rail_cfg = FabricConfig {
                bind_node: node.clone(),
                rails: Vec::new(),
                ..cfg.clone()
            };
            let ep = Endpoint::open(&rail_cfg, hmem)?;
            let mut mrs = Vec::with_capacity(regions.len());
            for (i, r) in regions.iter().enumerate() {
                mrs.push(ep.register(r, i)?);
            }
            tracing::info!(
                rail = k,
                node = node.as_deref().unwrap_or("-"),
                provider = %ep.provider,
                mr_mode = format_args!("{:#x}", ep.mr_mode),
                tx_size = ep.limits.tx_size,
                iovs_per_read = ep.limits.iovs_per_read,
                max_msg_bytes = ep.limits.max_msg_bytes,
                wait_fd = ep.wait_fd.is_some(),
                "libfabric endpoint open"
            );
            rails.push(state::Rail {
                mrs,
                ep,
                outstanding: AtomicUsize::new(0),
                bytes: AtomicU64::new(0),
            });
        }
        let limits = rails
            .iter()
            .map(|r| r.ep.limits)
            .reduce(|a, b| Limits {
                tx_size: a.tx_size.min(b.tx_size),
                iovs_per_read: a.iovs_per_read.min(b.iovs_per_read),
                max_msg_bytes: a.max_msg_bytes.min(b.max_msg_bytes),
            })
            .expect("at least one rail");
        let shared = Arc::new(Shared {
            rails,
            limits,
            peers: RwLock::new(Vec::new()),
            retired: Mutex::new(Vec::new()),
            retired_any: AtomicBool::new(false),
            pending: Mutex::new(HashMap::new()),
            backlog: Mutex::new(state::Backlog::new()),
            queued: AtomicUsize::new(0),
            driving: AtomicBool::new(false),
            last_drive_ns: AtomicU64::new(0),
            outstanding: AtomicUsize::new(0),
            next_read: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            // SAFETY: eventfd has no memory-safety preconditions.
            waker: unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) },
            serve_until_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            cfg,
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvloop-fabric-progress".into())
            .spawn(move || progress_loop(&s2))
            .map_err(|e| DataplaneError::io("spawn progress thread", e))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Provider limits in force (the smallest of every rail's).
    pub fn limits(&self) -> Limits {
        self.shared.limits
    }

    /// Whether efa emulates RMA READ in software (`None`: not efa / unknown).
    pub fn emulated_read(&self) -> Option<bool> {
        self.shared.ep().emulated_read
    }

    /// The provider's memory-registration mode bits (`FI_MR_*`).
    pub fn mr_mode(&self) -> u64 {
        self.shared.ep().mr_mode
    }

    /// Endpoints open: the configured rails, or 1.
    pub fn rail_count(&self) -> usize {
        self.shared.rails.len()
    }
}

impl TransferBackend for FabricBackend {
    fn name(&self) -> String {
        self.shared.ep().name()
    }

    fn kind(&self) -> kvloop_common::BackendKind {
        kvloop_common::BackendKind::Libfabric
    }

    fn metadata(&self) -> BackendMetadata {
        let remote = |r: &state::Rail| r.mrs.iter().map(|m| m.remote).collect::<Vec<_>>();
        let first = &self.shared.rails[0];
        BackendMetadata::Libfabric {
            provider: first.ep.provider.clone(),
            address: first.ep.address.clone(),
            regions: remote(first),
            rails: self.shared.rails[1..]
                .iter()
                .map(|r| RailEndpoint {
                    address: r.ep.address.clone(),
                    regions: remote(r),
                })
                .collect(),
        }
    }

    fn check_peer(&self, engine_id: &str, peer: &BackendMetadata) -> Result<()> {
        match peer {
            BackendMetadata::Libfabric { provider, .. } => {
                let ours = &self.shared.ep().provider;
                if provider != ours {
                    return Err(mismatch(
                        engine_id,
                        "provider",
                        ours.clone(),
                        provider.clone(),
                    ));
                }
                let n = self.shared.rails[0].mrs.len();
                for (_, regions) in peer.fabric_rails() {
                    if regions.len() != n {
                        return Err(mismatch(
                            engine_id,
                            "regions",
                            n.to_string(),
                            regions.len().to_string(),
                        ));
                    }
                }
                Ok(())
            }
            other => Err(mismatch(
                engine_id,
                "backend",
                "libfabric".into(),
                other.describe(),
            )),
        }
    }

    fn add_peer(&self, _engine_id: &str, peer: &BackendMetadata) -> Result<PeerSlot> {
        let theirs = peer.fabric_rails();
        assert!(!theirs.is_empty(), "check_peer refuses other backends");
        // Local rail k reads the peer's rail k mod n.
        let mut rails: Vec<state::PeerRail> = Vec::with_capacity(self.shared.rails.len());
        for (k, rail) in self.shared.rails.iter().enumerate() {
            let (address, regions) = theirs[k % theirs.len()];
            match rail.ep.insert_peer(address) {
                Ok(fi_addr) => rails.push(state::PeerRail {
                    fi_addr,
                    regions: regions.to_vec(),
                }),
                Err(e) => {
                    // Nothing was posted to the entries inserted so far.
                    for (j, p) in rails.iter().enumerate() {
                        self.shared.rails[j].ep.remove_peer(p.fi_addr);
                    }
                    return Err(e);
                }
            }
        }
        let mut peers = self.shared.peers.write();
        peers.push(Some(PeerEntry {
            rails,
            gone: AtomicBool::new(false),
        }));
        Ok(PeerSlot(peers.len() - 1))
    }

    fn remove_peer(&self, slot: PeerSlot) {
        if let Some(p) = self
            .shared
            .peers
            .read()
            .get(slot.0)
            .and_then(Option::as_ref)
        {
            p.gone.store(true, Ordering::Release);
        }
        // The write lock waits for READs being posted to finish posting.
        let gone = self
            .shared
            .peers
            .write()
            .get_mut(slot.0)
            .and_then(Option::take);
        if let Some(p) = gone {
            self.shared
                .retired
                .lock()
                .extend(p.rails.iter().enumerate().map(|(k, r)| (k, r.fi_addr)));
            self.shared.retired_any.store(true, Ordering::Release);
            self.shared.reap_retired();
        }
    }

    fn rail_bytes(&self) -> Vec<u64> {
        self.shared
            .rails
            .iter()
            .map(|r| r.bytes.load(Ordering::Relaxed))
            .collect()
    }

    fn kick(&self, expected: Duration) {
        let s = &self.shared;
        // Serve for the expected duration plus the spin window, at most 1 s
        // per hint (a longer READ sends no further hints, but its traffic
        // keeps arriving while we spin; the window is renewed by every hint).
        let until = s.epoch.elapsed()
            + expected.min(Duration::from_secs(1))
            + Duration::from_micros(s.cfg.spin_us);
        s.serve_until_ns
            .fetch_max(until.as_nanos() as u64, Ordering::AcqRel);
        s.wake();
    }

    fn quiesce(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.shared.outstanding.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline || self.thread.is_none() {
                return false;
            }
            self.shared.wake();
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    fn post_read(&self, slot: PeerSlot, segments: &[Segment], done: Completion) {
        self.shared.post_read(slot, segments, done);
    }

    fn caller_spin(&self) -> Duration {
        Duration::from_micros(self.shared.cfg.caller_spin_us)
    }

    fn drive_begin(&self) -> bool {
        self.shared.drive_begin()
    }

    fn drive(&self) {
        self.shared.drive();
    }

    fn drive_end(&self) {
        self.shared.drive_end();
    }
}

impl Drop for FabricBackend {
    fn drop(&mut self) {
        // Let in-flight operations finish (bounded) before closing anything:
        // closing an endpoint or registration under an outstanding READ can
        // crash inside the provider.
        let quiet = self.quiesce(Duration::from_secs(2));
        if !quiet {
            tracing::warn!(
                outstanding = self.shared.outstanding.load(Ordering::Acquire),
                "libfabric backend dropped with READs in flight: leaking the endpoint and registrations"
            );
        }
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            self.shared.wake();
            let _ = t.join();
        }
        // Fail whatever is still pending: the endpoint is going away.
        self.shared.backlog.lock().queue.clear();
        self.shared.queued.store(0, Ordering::Release);
        for (_, p) in self.shared.pending.lock().drain() {
            if let Some(d) = p.done {
                d.complete(Err(DataplaneError::Shutdown));
            }
        }
        if !quiet {
            // Never close provider objects under in-flight operations.
            std::mem::forget(self.shared.clone());
        }
    }
}
