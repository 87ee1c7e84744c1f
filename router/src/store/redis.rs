//! Redis backend of the conversation store, shared by router replicas.
//!
//! - Single use across replicas: a take is one `GETDEL` (atomic in Redis), so
//!   of concurrent takes of one key exactly one gets the value.
//! - TTL: `SET key value PX ttl GET` (Redis ≥ 6.2); Redis drops the key at
//!   expiry, `GET` returns the turn it replaced (reported as
//!   [`DropCause::Replaced`](super::DropCause::Replaced)).
//! - A bounded pool of `store_pool_size` multiplexed connections used round
//!   robin; every command is bounded by `store_timeout_ms`.
//! - Outage: a connection that fails (I/O error, refused, timeout) leaves the
//!   pool at once; while the pool is empty every call answers
//!   [`StoreError::Unavailable`] without waiting, so the router recomputes.
//!   A supervisor task refills the pool with exponential back-off (`backon`:
//!   `store_reconnect_min_ms` doubling up to `store_reconnect_max_ms`, with
//!   jitter) and ends when the store is dropped.
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, RedisError};
use backon::{ExponentialBuilder, Retryable};
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::{
    ConvKey, ConversationStore, DropCause, Dropped, Evictions, Lookup, StoreError, StoreHealth,
    StoreMetrics, StoredTurn, codec,
};
use crate::config::RouterConfig;

/// Options of a [`RedisStore`] (from [`RouterConfig`]'s `store_*` fields).
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Redis URL.
    pub url: String,
    /// Connections in the pool (≥ 1).
    pub pool_size: usize,
    /// TTL of stored turns, ms.
    pub ttl_ms: u64,
    /// Timeout of one command.
    pub timeout: Duration,
    /// Timeout of one connection attempt.
    pub connect_timeout: Duration,
    /// First reconnection back-off.
    pub reconnect_min: Duration,
    /// Largest reconnection back-off.
    pub reconnect_max: Duration,
    /// Key prefix.
    pub key_prefix: String,
}

impl RedisOptions {
    /// Options from `cfg` for the Redis at `url`.
    pub fn from_config(cfg: &RouterConfig, url: &str) -> Self {
        Self {
            url: url.to_string(),
            pool_size: cfg.store_pool_size.max(1),
            ttl_ms: cfg.store_ttl_ms(),
            timeout: Duration::from_millis(cfg.store_timeout_ms),
            connect_timeout: Duration::from_millis(cfg.store_connect_timeout_ms),
            reconnect_min: Duration::from_millis(cfg.store_reconnect_min_ms),
            reconnect_max: Duration::from_millis(cfg.store_reconnect_max_ms),
            key_prefix: cfg.store_key_prefix.clone(),
        }
    }
}

struct Slot {
    /// Bumped on every new connection, so a failure only removes the
    /// connection that failed.
    generation: u64,
    conn: MultiplexedConnection,
}

struct Inner {
    client: Client,
    opts: RedisOptions,
    engine_ids: Vec<String>,
    slots: Vec<RwLock<Option<Slot>>>,
    next: AtomicUsize,
    generation: AtomicU64,
    wake: Arc<Notify>,
    supervised: AtomicBool,
    last_error: Mutex<Option<String>>,
    reconnects: AtomicU64,
    metrics: StoreMetrics,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Let the supervisor see that the store is gone and end.
        self.wake.notify_one();
    }
}

/// The Redis conversation store. Cheap to clone (shared state).
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl RedisStore {
    /// A store on `opts.url`; `engine_ids` are the registry's ids in index
    /// order. Connects in the background (on the current tokio runtime, or on
    /// the first call when there is none): until connected, calls answer
    /// [`StoreError::Unavailable`].
    ///
    /// # Errors
    /// [`StoreError::Redis`] when the URL is not a Redis URL.
    pub fn new(
        opts: RedisOptions,
        engine_ids: Vec<String>,
        metrics: StoreMetrics,
    ) -> Result<Self, StoreError> {
        let client =
            Client::open(opts.url.as_str()).map_err(|e| StoreError::Redis(e.to_string()))?;
        metrics.up.set(0);
        let inner = Arc::new(Inner {
            client,
            slots: (0..opts.pool_size.max(1))
                .map(|_| RwLock::new(None))
                .collect(),
            opts,
            engine_ids,
            next: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            wake: Arc::new(Notify::new()),
            supervised: AtomicBool::new(false),
            last_error: Mutex::new(Some("not connected yet".into())),
            reconnects: AtomicU64::new(0),
            metrics,
        });
        let s = Self { inner };
        if tokio::runtime::Handle::try_current().is_ok() {
            s.ensure_supervisor();
        }
        Ok(s)
    }

    fn ensure_supervisor(&self) {
        if !self.inner.supervised.swap(true, Ordering::AcqRel) {
            tokio::spawn(supervise(
                Arc::downgrade(&self.inner),
                self.inner.wake.clone(),
            ));
        }
    }

    /// Connections in the pool now.
    pub fn connected(&self) -> usize {
        self.inner
            .slots
            .iter()
            .filter(|s| s.read().is_some())
            .count()
    }

    /// A pooled connection (round robin), or `Unavailable` at once.
    fn conn(&self) -> Result<(usize, u64, MultiplexedConnection), StoreError> {
        self.ensure_supervisor();
        let n = self.inner.slots.len();
        let start = self.inner.next.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let i = (start + k) % n;
            if let Some(s) = &*self.inner.slots[i].read() {
                return Ok((i, s.generation, s.conn.clone()));
            }
        }
        let why = self
            .inner
            .last_error
            .lock()
            .clone()
            .unwrap_or_else(|| "no connection".into());
        Err(StoreError::Unavailable(why))
    }

    /// Record a failed command on slot `i` (generation `g`): broken
    /// connections leave the pool and the supervisor is woken.
    fn failed(
        &self,
        op: &'static str,
        i: usize,
        g: u64,
        e: StoreError,
        broken: bool,
    ) -> StoreError {
        self.inner.metrics.error(op);
        if broken {
            let mut slot = self.inner.slots[i].write();
            if slot.as_ref().is_some_and(|s| s.generation == g) {
                *slot = None;
            }
            drop(slot);
            *self.inner.last_error.lock() = Some(e.to_string());
            if self.connected() == 0 {
                self.inner.metrics.up.set(0);
                warn!(error = %e, "conversation store unreachable: turns recompute until it is back");
            }
            self.inner.wake.notify_one();
        }
        e
    }

    async fn run<T: ::redis::FromRedisValue>(
        &self,
        op: &'static str,
        cmd: ::redis::Cmd,
    ) -> Result<T, StoreError> {
        self.query(op, |mut conn| async move {
            cmd.query_async::<T>(&mut conn).await
        })
        .await
    }

    /// Runs `f` on a pooled connection, bounded by `store_timeout_ms`; a
    /// failure is counted under `op`, and a broken connection leaves the pool.
    async fn query<T, Fut>(
        &self,
        op: &'static str,
        f: impl FnOnce(MultiplexedConnection) -> Fut,
    ) -> Result<T, StoreError>
    where
        Fut: std::future::Future<Output = ::redis::RedisResult<T>>,
    {
        let (i, g, conn) = self.conn().inspect_err(|_| self.inner.metrics.error(op))?;
        match tokio::time::timeout(self.inner.opts.timeout, f(conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let broken = is_broken(&e);
                Err(self.failed(op, i, g, StoreError::Redis(e.to_string()), broken))
            }
            Err(_) => Err(self.failed(op, i, g, StoreError::Timeout { op }, true)),
        }
    }

    /// Shares this replica's load (`crate::load_share`) and reads every
    /// replica's: one pipeline of `HDEL` (the `forget` fields: replicas
    /// that stopped sharing), `HSET <prefix>:load <replica> <value>`,
    /// `PEXPIRE` (`ttl_ms`: the hash goes when every replica stopped) and
    /// `HGETALL`. Bounded by `store_timeout_ms` like every command.
    ///
    /// # Errors
    /// [`StoreError`] when Redis cannot be reached in time or answers an
    /// error.
    pub async fn exchange_load(
        &self,
        replica: &str,
        value: Vec<u8>,
        ttl_ms: u64,
        forget: &[String],
    ) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let key = format!("{}:load", self.inner.opts.key_prefix);
        let mut pipe = ::redis::pipe();
        if !forget.is_empty() {
            pipe.cmd("HDEL").arg(&key).arg(forget).ignore();
        }
        pipe.cmd("HSET").arg(&key).arg(replica).arg(value).ignore();
        pipe.cmd("PEXPIRE").arg(&key).arg(ttl_ms.max(1)).ignore();
        pipe.cmd("HGETALL").arg(&key);
        let (all,): (Vec<(String, Vec<u8>)>,) = self
            .query("load_share", |mut conn| async move {
                pipe.query_async(&mut conn).await
            })
            .await?;
        Ok(all)
    }

    fn decode(&self, bytes: &[u8], now_ms: u64) -> Result<StoredTurn, codec::DecodeError> {
        codec::decode(bytes, now_ms, |id| {
            self.inner
                .engine_ids
                .iter()
                .position(|e| e == id)
                .and_then(|i| u16::try_from(i).ok())
        })
    }
}

fn is_broken(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
}

impl ConversationStore for RedisStore {
    async fn insert(
        &self,
        key: ConvKey,
        turn: StoredTurn,
        now_ms: u64,
    ) -> Result<Evictions, StoreError> {
        let Some(d) = self.inner.engine_ids.get(usize::from(turn.decode_engine)) else {
            return Err(StoreError::Decode(codec::DecodeError::UnknownEngine(
                format!("#{}", turn.decode_engine),
            )));
        };
        let mut cmd = ::redis::cmd("SET");
        cmd.arg(codec::redis_key(&self.inner.opts.key_prefix, &key))
            .arg(codec::encode(&turn, d))
            .arg("PX")
            .arg(self.inner.opts.ttl_ms.max(1))
            .arg("GET");
        let old: Option<Vec<u8>> = self.run("insert", cmd).await?;
        let mut ev = Evictions::default();
        if let Some(b) = old
            && let Ok(t) = self.decode(&b, now_ms)
        {
            ev.dropped.push(Dropped {
                key,
                turn: t,
                cause: DropCause::Replaced,
            });
        }
        Ok(ev)
    }

    async fn take(&self, key: &ConvKey, now_ms: u64) -> Result<Lookup, StoreError> {
        let mut cmd = ::redis::cmd("GETDEL");
        cmd.arg(codec::redis_key(&self.inner.opts.key_prefix, key));
        let v: Option<Vec<u8>> = self.run("take", cmd).await?;
        match v {
            None => Ok(Lookup::Missing),
            Some(b) => match self.decode(&b, now_ms) {
                Ok(t) => Ok(Lookup::Found(t)),
                Err(e) => {
                    self.inner.metrics.error("decode");
                    Err(e.into())
                }
            },
        }
    }

    fn sweep(&self, _now_ms: u64) -> Vec<Dropped> {
        Vec::new()
    }

    fn entries(&self) -> Option<usize> {
        None
    }

    fn health(&self) -> StoreHealth {
        let up = self.connected() > 0;
        StoreHealth {
            backend: "redis",
            up,
            last_error: if up {
                None
            } else {
                self.inner.last_error.lock().clone()
            },
            reconnects: self.inner.reconnects.load(Ordering::Relaxed),
        }
    }
}

/// Connect once, bounded by the connect timeout.
async fn connect(inner: &Inner) -> Result<MultiplexedConnection, String> {
    let cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(inner.opts.connect_timeout)
        .set_response_timeout(inner.opts.timeout);
    match tokio::time::timeout(
        inner.opts.connect_timeout,
        inner
            .client
            .get_multiplexed_async_connection_with_config(&cfg),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("connect timed out".into()),
    }
}

/// Why a reconnection loop stopped retrying.
enum ConnectError {
    /// The store was dropped.
    Gone,
    /// An attempt failed (retried).
    Failed(String),
}

/// Refill empty pool slots, with back-off, whenever woken; end once the
/// store is dropped.
async fn supervise(weak: Weak<Inner>, wake: Arc<Notify>) {
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let Some(n) = weak.upgrade().map(|i| i.slots.len()) else {
            return;
        };
        for i in 0..n {
            let empty = match weak.upgrade() {
                Some(inner) => inner.slots[i].read().is_none(),
                None => return,
            };
            if !empty {
                continue;
            }
            let (min, max) = match weak.upgrade() {
                Some(inner) => (inner.opts.reconnect_min, inner.opts.reconnect_max),
                None => return,
            };
            let attempt = || async {
                let inner = weak.upgrade().ok_or(ConnectError::Gone)?;
                connect(&inner).await.map_err(ConnectError::Failed)
            };
            let r = attempt
                .retry(
                    ExponentialBuilder::default()
                        .with_min_delay(min)
                        .with_max_delay(max)
                        .with_jitter()
                        .without_max_times(),
                )
                .when(|e| matches!(e, ConnectError::Failed(_)))
                .notify(|e, _| {
                    if let (ConnectError::Failed(msg), Some(inner)) = (e, weak.upgrade()) {
                        inner.metrics.error("connect");
                        *inner.last_error.lock() = Some(msg.clone());
                    }
                })
                .await;
            let Ok(conn) = r else { return };
            let Some(inner) = weak.upgrade() else { return };
            let was_down = inner.slots.iter().all(|s| s.read().is_none());
            let generation = inner.generation.fetch_add(1, Ordering::Relaxed);
            *inner.slots[i].write() = Some(Slot { generation, conn });
            inner.metrics.up.set(1);
            if was_down {
                let first = inner.last_error.lock().take();
                if first.as_deref() != Some("not connected yet") {
                    inner.reconnects.fetch_add(1, Ordering::Relaxed);
                    inner.metrics.reconnects.inc();
                    info!("conversation store reachable again");
                }
            }
        }
        notified.await;
    }
}
