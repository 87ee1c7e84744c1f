//! Conversation store (docs/protocol.md Router rule 1): D's params of each
//! conversation's last finished turn, single use, kept for a TTL.
//!
//! One trait, [`ConversationStore`], two backends:
//! - [`memory::MemoryStore`] (default, `store = "memory"`): in this process,
//!   bounded by `store_capacity` with LRU eviction; pure, injected time.
//! - [`redis::RedisStore`] (`store = "redis://..."`): shared by every router
//!   replica. Single use is atomic across replicas (`GETDEL`), the TTL is
//!   Redis's key expiry (`SET ... PX`), keys are scoped by tenant
//!   ([`codec::redis_key`]), values are compact ([`codec::encode`]). Every
//!   command has a timeout; when Redis is unreachable the router keeps serving
//!   (every turn recomputes), reports it in `/health` (`store.status:
//!   "degraded"`) and metrics (`kvloop_router_store_up 0`), and reconnects by
//!   itself with exponential back-off.
//!
//! [`Store`] is what the server holds: either backend behind one value, with
//! the request-path helpers that never fail ([`Store::take`] reads an
//! unreachable store as "no entry").
//!
//! Hook for decode-side retention (issue 15): every turn that leaves the
//! store other than by `take` is reported as a [`Dropped`] (by
//! [`ConversationStore::insert`], [`ConversationStore::sweep`], and to the
//! sink set with [`Store::set_drop_sink`]). The Redis backend reports the
//! turn an insert replaced; turns that Redis expires are not reported.
pub mod codec;
pub mod memory;
pub mod redis;

use std::future::Future;
use std::num::NonZeroUsize;

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{Value, json};

use crate::config::{RouterConfig, StoreBackend};
use crate::fingerprint::Fingerprint;
use crate::metrics::{CauseLabel, Metrics, OpLabel};
use crate::params::CompactParams;

pub use memory::MemoryStore;

/// Key of a conversation: tenant and the client's `conversation_id`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConvKey {
    tenant: Box<str>,
    conversation_id: Box<str>,
}

impl ConvKey {
    /// Key for `tenant` / `conversation_id`.
    pub fn new(tenant: &str, conversation_id: &str) -> Self {
        Self {
            tenant: tenant.into(),
            conversation_id: conversation_id.into(),
        }
    }
    /// Tenant.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }
    /// The client's conversation id.
    pub fn conversation_id(&self) -> &str {
        &self.conversation_id
    }
    /// Heap bytes owned.
    pub fn heap_bytes(&self) -> usize {
        self.tenant.len() + self.conversation_id.len()
    }
    /// A digest that names this conversation in what router replicas
    /// share of their prefill lines (`crate::select::share`): xxh3-64 of
    /// tenant, NUL, conversation id; never 0 (0 names no conversation).
    pub fn digest(&self) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(self.tenant.as_bytes());
        h.update(&[0]);
        h.update(self.conversation_id.as_bytes());
        h.digest().max(1)
    }
}

/// D's params of a finished turn and what they cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTurn {
    /// D's params, compact.
    pub params: CompactParams,
    /// Index of D in the engine registry.
    pub decode_engine: u16,
    /// `remote_num_tokens` of D's params (prompt + generated − 1).
    pub remote_num_tokens: u32,
    /// What the blocks cover.
    pub fingerprint: Fingerprint,
    /// Expiry on the router's clock, ms (memory backend; the Redis backend
    /// sets it to the time of the take, Redis keeping the real expiry).
    pub expires_at_ms: u64,
    /// When it was stored, Unix ms (wall clock; 0: unknown). Carried in
    /// the shared store so that the replica that takes the next turn can
    /// measure the inter-turn gap of a turn another replica stored
    /// (decode-side retention).
    pub stored_at_unix_ms: u64,
}

/// Result of a take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Nothing stored (with Redis, also: expired, since Redis drops the key).
    Missing,
    /// An entry was stored but its TTL has passed (it is removed).
    Expired,
    /// A live entry, now removed from the store (single use).
    Found(StoredTurn),
}

/// Why a stored turn left the store other than by a take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropCause {
    /// Evicted by the capacity bound.
    Lru,
    /// Its TTL passed.
    Expired,
    /// Overwritten by a newer turn of the same conversation.
    Replaced,
}

/// A stored turn that left the store without being taken: D still holds its
/// blocks, which nobody will pull (issue 15's early release starts here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Its conversation.
    pub key: ConvKey,
    /// The turn (D in `decode_engine`, its params).
    pub turn: StoredTurn,
    /// Why.
    pub cause: DropCause,
}

/// What an insert dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evictions {
    /// Evicted by the capacity bound.
    pub lru: u64,
    /// Dropped at TTL.
    pub expired: u64,
    /// The turns dropped (replaced or evicted).
    pub dropped: Vec<Dropped>,
}

/// A store operation that failed (the Redis backend; memory never fails).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No connection to Redis (down, or reconnecting with back-off).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The command took longer than `store_timeout_ms`.
    #[error("store: {op} timed out")]
    Timeout {
        /// `take` or `insert`.
        op: &'static str,
    },
    /// Redis answered an error.
    #[error("store: {0}")]
    Redis(String),
    /// The stored value cannot be used (it has been removed).
    #[error(transparent)]
    Decode(#[from] codec::DecodeError),
}

/// Health of a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreHealth {
    /// `memory` or `redis`.
    pub backend: &'static str,
    /// Reachable (memory: always).
    pub up: bool,
    /// Last error seen, while not up.
    pub last_error: Option<String>,
    /// Successful reconnections since start.
    pub reconnects: u64,
}

/// A conversation store backend.
pub trait ConversationStore: Send + Sync {
    /// Store (overwriting) a turn at `now_ms`, live for the store's TTL.
    /// Returns what it dropped.
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached in time.
    fn insert(
        &self,
        key: ConvKey,
        turn: StoredTurn,
        now_ms: u64,
    ) -> impl Future<Output = Result<Evictions, StoreError>> + Send;

    /// Remove and return the entry of `key` (single use: of concurrent takes
    /// of one key, across replicas too, at most one finds it).
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached in time, or the
    /// value cannot be used.
    fn take(
        &self,
        key: &ConvKey,
        now_ms: u64,
    ) -> impl Future<Output = Result<Lookup, StoreError>> + Send;

    /// Drop what expired by `now_ms` and return it (Redis: nothing, it expires
    /// keys itself).
    fn sweep(&self, now_ms: u64) -> Vec<Dropped>;

    /// Entries stored (memory); `None` where unknown (Redis, shared).
    fn entries(&self) -> Option<usize>;

    /// Reachability.
    fn health(&self) -> StoreHealth;
}

/// The memory backend behind a lock.
pub struct MemoryBackend(Mutex<MemoryStore>);

impl MemoryBackend {
    /// At most `capacity` entries, each live for `ttl_ms`.
    pub fn new(capacity: NonZeroUsize, ttl_ms: u64) -> Self {
        Self(Mutex::new(MemoryStore::new(capacity, ttl_ms)))
    }
}

impl ConversationStore for MemoryBackend {
    async fn insert(
        &self,
        key: ConvKey,
        turn: StoredTurn,
        now_ms: u64,
    ) -> Result<Evictions, StoreError> {
        Ok(self.0.lock().insert(key, turn, now_ms))
    }
    async fn take(&self, key: &ConvKey, now_ms: u64) -> Result<Lookup, StoreError> {
        Ok(self.0.lock().take(key, now_ms))
    }
    fn sweep(&self, now_ms: u64) -> Vec<Dropped> {
        self.0.lock().drain_expired(now_ms)
    }
    fn entries(&self) -> Option<usize> {
        Some(self.0.lock().len())
    }
    fn health(&self) -> StoreHealth {
        StoreHealth {
            backend: "memory",
            up: true,
            last_error: None,
            reconnects: 0,
        }
    }
}

/// The store's series, clones of [`Metrics`]' (one registry, one
/// `/metrics`): `store_entries`, `store_evictions_total{cause}`,
/// `store_up`, `store_errors_total{op}`, `store_reconnects_total`.
#[derive(Clone)]
pub struct StoreMetrics {
    /// `kvloop_router_store_up`.
    pub up: Gauge,
    /// `kvloop_router_store_errors_total{op}`.
    pub errors: Family<OpLabel, Counter>,
    /// `kvloop_router_store_reconnects_total`.
    pub reconnects: Counter,
    entries: Gauge,
    evictions: Family<CauseLabel, Counter>,
}

impl StoreMetrics {
    /// The store's series of `m`.
    pub fn new(m: &Metrics) -> Self {
        Self {
            up: m.store_up.clone(),
            errors: m.store_errors.clone(),
            reconnects: m.store_reconnects.clone(),
            entries: m.store_entries.clone(),
            evictions: m.evictions.clone(),
        }
    }

    /// Count a failed operation.
    pub fn error(&self, op: &'static str) {
        self.errors.get_or_create(&OpLabel { op }).inc();
    }

    fn dropped(&self, d: &[Dropped]) {
        for x in d {
            let cause = match x.cause {
                DropCause::Lru => "lru",
                DropCause::Expired => "expired",
                DropCause::Replaced => continue,
            };
            self.evictions.get_or_create(&CauseLabel { cause }).inc();
        }
    }
}

enum Backend {
    Memory(MemoryBackend),
    Redis(redis::RedisStore),
}

/// The store the server holds: the configured backend, its metrics, and the
/// sink of dropped turns.
pub struct Store {
    backend: Backend,
    metrics: StoreMetrics,
    drop_sink: std::sync::OnceLock<tokio::sync::mpsc::Sender<Dropped>>,
}

impl Store {
    /// The backend `cfg.store` names. `engine_ids` are the registry's ids in
    /// index order (the Redis backend stores D by id).
    ///
    /// # Errors
    /// [`StoreError::Redis`] when the Redis URL is not usable.
    pub fn from_config(
        cfg: &RouterConfig,
        engine_ids: Vec<String>,
        metrics: &Metrics,
    ) -> Result<Self, StoreError> {
        let metrics = StoreMetrics::new(metrics);
        let backend = match cfg.store_backend() {
            StoreBackend::Memory => Backend::Memory(MemoryBackend::new(
                NonZeroUsize::new(cfg.store_capacity).unwrap_or(NonZeroUsize::MIN),
                cfg.store_ttl_ms(),
            )),
            StoreBackend::Redis(url) => Backend::Redis(redis::RedisStore::new(
                redis::RedisOptions::from_config(cfg, url),
                engine_ids,
                metrics.clone(),
            )?),
        };
        Ok(Self {
            backend,
            metrics,
            drop_sink: std::sync::OnceLock::new(),
        })
    }

    /// Send every [`Dropped`] turn to `tx` from now on (`try_send`: a full
    /// channel loses the report, never blocks a request). Once only; later
    /// calls are ignored.
    pub fn set_drop_sink(&self, tx: tokio::sync::mpsc::Sender<Dropped>) {
        let _ = self.drop_sink.set(tx);
    }

    fn report(&self, dropped: Vec<Dropped>) {
        self.metrics.dropped(&dropped);
        if let Some(tx) = self.drop_sink.get() {
            for d in dropped {
                let _ = tx.try_send(d);
            }
        }
    }

    fn publish_len(&self) {
        if let Some(n) = self.entries() {
            self.metrics.entries.set(n as i64);
        }
    }

    /// The request path's take: an unreachable store or an unusable value
    /// reads as [`Lookup::Missing`] (the turn recomputes), counted in
    /// `kvloop_router_store_errors_total`.
    pub async fn take_or_missing(&self, key: &ConvKey, now_ms: u64) -> Lookup {
        let r = ConversationStore::take(self, key, now_ms).await;
        self.publish_len();
        match r {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "store take failed: recompute");
                Lookup::Missing
            }
        }
    }

    /// Insert and wait for it (Redis: one command, bounded by the pool's
    /// command timeout); a failure is counted in
    /// `kvloop_router_store_errors_total` by the backend and the
    /// conversation's next turn recomputes.
    pub async fn insert_or_count(&self, key: ConvKey, turn: StoredTurn, now_ms: u64) {
        if let Ok(ev) = ConversationStore::insert(self, key, turn, now_ms).await {
            self.report(ev.dropped);
        }
        self.publish_len();
    }

    /// Drop expired entries now (memory), updating the metrics.
    pub fn sweep_now(&self, now_ms: u64) {
        let d = ConversationStore::sweep(self, now_ms);
        self.report(d);
        self.publish_len();
    }

    /// Whether the store is shared by replicas (Redis).
    pub fn is_shared(&self) -> bool {
        matches!(self.backend, Backend::Redis(_))
    }

    /// Shares this replica's load and reads every replica's
    /// ([`redis::RedisStore::exchange_load`]); the memory store shares
    /// nothing and answers `Ok(None)`.
    ///
    /// # Errors
    /// [`StoreError`] from Redis (counted in `store_errors_total{op="load_share"}`).
    pub async fn exchange_load(
        &self,
        replica: &str,
        value: Vec<u8>,
        ttl_ms: u64,
        forget: &[String],
    ) -> Result<Option<Vec<(String, Vec<u8>)>>, StoreError> {
        match &self.backend {
            Backend::Memory(_) => Ok(None),
            Backend::Redis(r) => r
                .exchange_load(replica, value, ttl_ms, forget)
                .await
                .map(Some),
        }
    }

    /// Entries stored, 0 where unknown (Redis).
    pub fn len_or_zero(&self) -> usize {
        self.entries().unwrap_or(0)
    }

    /// The `store` object of `/health`: `{"backend", "status": "ok" |
    /// "degraded", "last_error", "reconnects"}`.
    pub fn health_json(&self) -> Value {
        let h = self.health();
        json!({"backend": h.backend, "status": if h.up { "ok" } else { "degraded" },
               "last_error": h.last_error, "reconnects": h.reconnects})
    }
}

impl ConversationStore for Store {
    async fn insert(
        &self,
        key: ConvKey,
        turn: StoredTurn,
        now_ms: u64,
    ) -> Result<Evictions, StoreError> {
        match &self.backend {
            Backend::Memory(m) => m.insert(key, turn, now_ms).await,
            Backend::Redis(r) => r.insert(key, turn, now_ms).await,
        }
    }
    async fn take(&self, key: &ConvKey, now_ms: u64) -> Result<Lookup, StoreError> {
        match &self.backend {
            Backend::Memory(m) => m.take(key, now_ms).await,
            Backend::Redis(r) => r.take(key, now_ms).await,
        }
    }
    fn sweep(&self, now_ms: u64) -> Vec<Dropped> {
        match &self.backend {
            Backend::Memory(m) => m.sweep(now_ms),
            Backend::Redis(r) => r.sweep(now_ms),
        }
    }
    fn entries(&self) -> Option<usize> {
        match &self.backend {
            Backend::Memory(m) => m.entries(),
            Backend::Redis(r) => r.entries(),
        }
    }
    fn health(&self) -> StoreHealth {
        match &self.backend {
            Backend::Memory(m) => m.health(),
            Backend::Redis(r) => r.health(),
        }
    }
}
