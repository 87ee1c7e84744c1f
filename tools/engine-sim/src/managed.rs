//! The simulator's link to its node agent (`kvloop-agent`) over the agent's
//! local API (`kvloop-agent-api`: a Unix stream socket, length-prefixed JSON,
//! memfds passed by `SCM_RIGHTS`).
//!
//! - [`AgentLink`]: a pool of connections to the agent. Each connection
//!   carries one request at a time (a managed READ holds its connection for
//!   the READ's duration), so concurrent requests each take their own
//!   connection; a connection whose request failed at the socket level or
//!   was cancelled (its caller's future dropped) is dropped, not reused.
//!   It also keeps the agent's liveness as the engine sees it
//!   ([`AgentLink::health`], [`AgentLink::metrics_text`]).
//! - [`Registration`] (`--kv-mode agent`, managed mode): the engine's memfd
//!   KV regions registered with the agent, which maps the same pages, serves
//!   remote READs of them on the side channel it returns, and keeps the
//!   engine's leases. The registration lives as long as its connection.
//! - [`AgentTransfer`]: the managed-mode [`KvTransfer`]: the agent connects
//!   to the owner's side channel, renews the owner's lease through the
//!   owner's agent (declining blocks that expire within the safety margin or
//!   that the lease does not cover), READs into this engine's blocks and
//!   notifies the owner.
//! - [`run_events`]: the owner side: waits for the agent's events and hands
//!   every release (owner notification received, lease expired) back to the
//!   engine, which frees the blocks. When the agent is lost (killed,
//!   restarted on the same socket) it drops every hold leased at the lost
//!   agent (the new agent has none of them, so both sides agree that none
//!   exists), re-registers the same memory on the same side-channel port with
//!   back-off ([`kvloop_agent_api::reconnect`]), and goes on.
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

pub use kvloop_agent_api::client::{AgentClient, ClientError};
pub use kvloop_agent_api::proto::ErrorKind;
use kvloop_agent_api::proto::{EngineEvent, ReadDirection};
use kvloop_agent_api::reconnect::{Backoff, ReconnectError, connect_with_backoff};
use kvloop_dataplane::{HostRegion, KvLayout};
use tracing::{info, warn};

pub use crate::transfer::resolve_side_channel;
use crate::transfer::{KvTransfer, ReadFuture, ReadRequest, TransferError};

/// Locks a std mutex, tolerating poison (the data are plain sets and lists).
fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Most idle connections kept in an [`AgentLink`]'s pool.
const MAX_IDLE_CONNECTIONS: usize = 16;

/// A pool of connections to the node agent's local API.
pub struct AgentLink {
    path: PathBuf,
    client_name: String,
    idle: Mutex<Vec<AgentClient>>,
    backoff: Backoff,
    /// The agent is lost: set from the loss until the re-registration.
    lost: AtomicBool,
    lost_total: AtomicU64,
    reregistered_total: AtomicU64,
    /// Registrations made through this link, by engine id (to re-register).
    regs: Mutex<HashMap<String, Weak<RegState>>>,
}

/// The node agent as an engine sees it ([`AgentLink::health`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentHealth {
    /// `false` from the moment the agent was lost (its connection closed,
    /// the engine unknown there) until the engine is registered again.
    pub connected: bool,
    /// Times the agent was lost.
    pub lost_total: u64,
    /// Times the engine registered again after a loss.
    pub reregistered_total: u64,
}

/// A connection taken from an [`AgentLink`]; goes back to the pool when
/// dropped unless [`Pooled::discard`]ed.
pub struct Pooled<'a> {
    link: &'a AgentLink,
    client: Option<AgentClient>,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = AgentClient;
    fn deref(&self) -> &AgentClient {
        self.client
            .as_ref()
            .expect("pooled client present until drop")
    }
}

impl Pooled<'_> {
    /// Drops the connection instead of returning it (after an I/O error).
    pub fn discard(mut self) {
        self.client = None;
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.client.take().filter(|c| !c.is_poisoned()) {
            let mut idle = self.link.idle.lock().unwrap();
            if idle.len() < MAX_IDLE_CONNECTIONS {
                idle.push(c);
            }
        }
    }
}

impl AgentLink {
    /// Connects once (hello, protocol version check) to fail early when the
    /// agent is absent or refuses.
    ///
    /// # Errors
    /// The socket error or the agent's refusal.
    pub async fn connect(path: &Path, client_name: &str) -> Result<Self, ClientError> {
        let first = AgentClient::connect(path, client_name).await?;
        Ok(Self::with_first(
            path,
            client_name,
            Some(first),
            Backoff::default(),
        ))
    }

    fn with_first(
        path: &Path,
        client_name: &str,
        first: Option<AgentClient>,
        backoff: Backoff,
    ) -> Self {
        Self {
            path: path.to_path_buf(),
            client_name: client_name.to_string(),
            idle: Mutex::new(first.into_iter().collect()),
            backoff,
            lost: AtomicBool::new(false),
            lost_total: AtomicU64::new(0),
            reregistered_total: AtomicU64::new(0),
            regs: Mutex::new(HashMap::new()),
        }
    }

    /// Sets the back-off between reconnection attempts after the agent was
    /// lost (default: [`Backoff::default`], 50 ms doubling to 2 s).
    pub fn set_backoff(&mut self, backoff: Backoff) {
        self.backoff = backoff;
    }

    /// The agent's liveness as this engine sees it.
    pub fn health(&self) -> AgentHealth {
        AgentHealth {
            connected: !self.lost.load(Ordering::Acquire),
            lost_total: self.lost_total.load(Ordering::Relaxed),
            reregistered_total: self.reregistered_total.load(Ordering::Relaxed),
        }
    }

    /// Drops every pooled connection (they lead to an agent that is gone).
    fn clear_idle(&self) {
        locked(&self.idle).clear();
    }

    fn registration_state(&self, engine_id: &str) -> Option<Arc<RegState>> {
        locked(&self.regs).get(engine_id).and_then(Weak::upgrade)
    }

    fn mark_lost(&self) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            self.lost_total.fetch_add(1, Ordering::Relaxed);
        }
        self.clear_idle();
    }

    fn mark_reregistered(&self) {
        self.reregistered_total.fetch_add(1, Ordering::Relaxed);
        self.lost.store(false, Ordering::Release);
    }

    /// The agent's socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A connection: an idle one, or a new one.
    ///
    /// # Errors
    /// The socket error when a new connection is needed and fails.
    pub async fn get(&self) -> Result<Pooled<'_>, ClientError> {
        let idle = locked(&self.idle).pop();
        let client = match idle {
            Some(c) => c,
            None => AgentClient::connect(&self.path, &self.client_name).await?,
        };
        Ok(Pooled {
            link: self,
            client: Some(client),
        })
    }

    /// Runs one request on a pooled connection; a connection whose request
    /// failed at the socket level is discarded.
    ///
    /// # Errors
    /// The request's [`ClientError`].
    pub async fn with<T, F>(&self, f: F) -> Result<T, ClientError>
    where
        F: AsyncFnOnce(&AgentClient) -> Result<T, ClientError>,
    {
        let c = self.get().await?;
        let r = f(&c).await;
        if matches!(
            r,
            Err(ClientError::Io(_) | ClientError::Closed | ClientError::Protocol(_))
        ) {
            c.discard();
        }
        r
    }

    /// Reports one prefill: `prompt_tokens` in all, `reused_tokens` of them
    /// READ instead of computed, `latency_us` from arrival to the first token.
    ///
    /// # Errors
    /// As [`AgentClient::record_prefill`].
    pub async fn record_prefill(
        &self,
        engine_id: &str,
        prompt_tokens: u64,
        reused_tokens: u64,
        latency_us: u64,
    ) -> Result<(), ClientError> {
        self.with(async |c| {
            c.record_prefill(engine_id, prompt_tokens, reused_tokens, latency_us)
                .await
        })
        .await
    }
}

/// What re-registering an engine needs, shared by its [`Registration`] and
/// the link (which finds it by engine id in [`run_events`]).
struct RegState {
    engine_id: String,
    layout: KvLayout,
    /// Duplicates of the engine's memfds (the same pages), in layout order.
    fds: Vec<OwnedFd>,
    len_bytes: Vec<u64>,
    /// The side channel of the first registration; re-registrations ask
    /// for the same port (it is in the params readers hold).
    side_channel: SocketAddr,
    /// The connection that made the registration: the agent unregisters the
    /// engine when it closes.
    conn: tokio::sync::Mutex<Option<AgentClient>>,
    /// Requests retained at the agent and not yet released.
    retained: Mutex<HashSet<String>>,
    /// Bumped at every re-registration (the agent's connections to remote
    /// engines are gone with the old agent).
    epoch: AtomicU64,
}

impl RegState {
    fn take_retained(&self) -> Vec<String> {
        locked(&self.retained).drain().collect()
    }

    fn forget_retained(&self, request_id: &str) {
        locked(&self.retained).remove(request_id);
    }

    /// Registers the memory again with the agent at `link`'s socket (after
    /// a loss), retrying with back-off while `keep_going()`; asks for the
    /// same side-channel port.
    async fn reregister(
        &self,
        link: &AgentLink,
        mut keep_going: impl FnMut() -> bool,
    ) -> Result<(), ReconnectError> {
        loop {
            let c =
                connect_with_backoff(&link.path, &self.engine_id, &link.backoff, &mut keep_going)
                    .await?;
            let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(|f| f.as_fd()).collect();
            let r = c
                .register_fds(
                    &self.engine_id,
                    self.layout,
                    &fds,
                    self.len_bytes.clone(),
                    Some(self.side_channel.port()),
                )
                .await;
            match r {
                Ok(addr) => {
                    if addr != self.side_channel {
                        warn!(engine = %self.engine_id, old = %self.side_channel, new = %addr,
                              "re-registered on another side channel: params already sent name the old one");
                    }
                    *self.conn.lock().await = Some(c);
                    self.epoch.fetch_add(1, Ordering::AcqRel);
                    link.clear_idle();
                    return Ok(());
                }
                Err(e) => {
                    warn!(engine = %self.engine_id, error = %e,
                          "registering again with the agent failed; retrying");
                    if !keep_going() {
                        return Err(ReconnectError::GaveUp(e));
                    }
                    tokio::time::sleep(link.backoff.max_delay).await;
                }
            }
        }
    }
}

/// An engine's KV memory registered with its node agent (managed mode).
pub struct Registration {
    link: Arc<AgentLink>,
    state: Arc<RegState>,
    agent_id: String,
}

impl Registration {
    /// Registers `regions` (memfds, in layout order) under `engine_id`;
    /// `side_channel_port` 0/`None` lets the agent pick.
    ///
    /// # Errors
    /// A message naming the failing step (connect, register).
    pub async fn register(
        link: Arc<AgentLink>,
        engine_id: &str,
        layout: KvLayout,
        regions: &[HostRegion],
        side_channel_port: Option<u16>,
    ) -> Result<Self, String> {
        let conn = AgentClient::connect(link.path(), engine_id)
            .await
            .map_err(|e| format!("agent_socket {}: {e}", link.path().display()))?;
        let side_channel = conn
            .register_memfd(engine_id, layout, regions, side_channel_port)
            .await
            .map_err(|e| format!("registering KV memory with the agent: {e}"))?;
        let fds = regions
            .iter()
            .map(|r| r.fd().try_clone_to_owned())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("duplicating the KV memfds (to register again later): {e}"))?;
        let state = Arc::new(RegState {
            engine_id: engine_id.to_string(),
            layout,
            fds,
            len_bytes: regions.iter().map(|r| r.len() as u64).collect(),
            side_channel,
            conn: tokio::sync::Mutex::new(None),
            retained: Mutex::new(HashSet::new()),
            epoch: AtomicU64::new(0),
        });
        let agent_id = conn.agent_id().to_string();
        *state.conn.lock().await = Some(conn);
        locked(&link.regs).insert(engine_id.to_string(), Arc::downgrade(&state));
        Ok(Self {
            agent_id,
            link,
            state,
        })
    }

    /// The engine id.
    pub fn engine_id(&self) -> &str {
        &self.state.engine_id
    }

    /// The side-channel address the agent serves this engine's blocks on
    /// (what `kv_transfer_params` carries as `remote_host`/`remote_port`).
    pub fn side_channel(&self) -> SocketAddr {
        self.state.side_channel
    }

    /// The agent's id (node name).
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// The connection pool.
    pub fn link(&self) -> &Arc<AgentLink> {
        &self.link
    }

    /// How many times the engine registered again (after agent losses).
    fn epoch(&self) -> u64 {
        self.state.epoch.load(Ordering::Acquire)
    }

    /// Retains `block_ids` of `request_id` for `ttl_ms`: readers' agents
    /// can then renew and READ them until released.
    ///
    /// # Errors
    /// The agent's refusal (`bad_request` naming the field).
    pub async fn retain(
        &self,
        request_id: &str,
        block_ids: &[u32],
        ttl_ms: u64,
    ) -> Result<(), ClientError> {
        let ids: Vec<u64> = block_ids.iter().map(|b| u64::from(*b)).collect();
        self.link
            .with(async |c| {
                c.retain(&self.state.engine_id, request_id, ids, Some(ttl_ms))
                    .await
                    .map(|_| ())
            })
            .await?;
        locked(&self.state.retained).insert(request_id.to_string());
        Ok(())
    }

    /// Releases the lease of `request_id` (the engine evicts its blocks).
    ///
    /// # Errors
    /// `lease` when nothing is retained.
    pub async fn release(&self, request_id: &str) -> Result<(), ClientError> {
        let r = self
            .link
            .with(async |c| c.release(&self.state.engine_id, request_id).await)
            .await;
        if r.is_ok() || matches!(&r, Err(ClientError::Api(e)) if e.kind == ErrorKind::Lease) {
            self.state.forget_retained(request_id);
        }
        r
    }
}

/// Waits for the agent's events of `engine_id` on a connection of its own
/// and calls `released(request_id)` for every lease the agent released
/// (all owner notifications received, TTL lapsed, owner release). Returns
/// `Ok` when `released` returns `false` (the engine is gone; checked at
/// least every second and before every reconnection attempt).
///
/// When the agent is lost (the connection closes: it was killed or
/// restarted; or it no longer hosts the engine) and the engine was
/// registered through `link` ([`Registration::register`]): marks the link
/// lost ([`AgentLink::health`]), calls `released` for every request retained
/// at the lost agent (the holds are gone there, so they go here too: no
/// reader can renew or READ them any more), registers the same memory again
/// with back-off, and waits for events again.
///
/// # Errors
/// For an engine not registered through `link`, the error that ended the
/// stream (the first connection's included); a refusal by the restarted
/// agent (`version`, `forbidden`).
pub async fn run_events(
    link: Arc<AgentLink>,
    engine_id: String,
    mut released: impl FnMut(Option<&str>) -> bool,
) -> Result<(), ClientError> {
    let name = format!("{engine_id}-events");
    let mut conn = Some(AgentClient::connect(link.path(), &name).await);
    loop {
        if !released(None) {
            return Ok(());
        }
        let r = match conn.take() {
            Some(Ok(c)) => c.events(&engine_id, 1000).await.map(|ev| (c, ev)),
            Some(Err(e)) => Err(e),
            // Not reached: every path back to the loop's head sets `conn`.
            None => Err(ClientError::Closed),
        };
        let e = match r {
            Ok((c, events)) => {
                conn = Some(Ok(c));
                let st = link.registration_state(&engine_id);
                for ev in events {
                    if let EngineEvent::Released(r) = ev {
                        if let Some(st) = &st {
                            st.forget_retained(&r.request_id);
                        }
                        if !released(Some(&r.request_id)) {
                            return Ok(());
                        }
                    }
                }
                continue;
            }
            Err(e) => e,
        };
        let lost = e.is_connection_lost()
            || matches!(&e, ClientError::Api(a) if a.kind == ErrorKind::UnknownEngine);
        let Some(st) = link.registration_state(&engine_id).filter(|_| lost) else {
            return Err(e);
        };
        link.mark_lost();
        let dropped = st.take_retained();
        warn!(engine = %engine_id, error = %e, holds_dropped = dropped.len(),
              "lost the node agent: holds leased there dropped; registering again");
        for id in &dropped {
            if !released(Some(id)) {
                return Ok(());
            }
        }
        match st.reregister(&link, || released(None)).await {
            Ok(()) => {}
            Err(ReconnectError::GaveUp(_)) if !released(None) => return Ok(()),
            Err(ReconnectError::GaveUp(e) | ReconnectError::Refused(e)) => return Err(e),
        }
        match connect_with_backoff(link.path(), &name, &link.backoff, || released(None)).await {
            Ok(c) => conn = Some(Ok(c)),
            Err(ReconnectError::GaveUp(_)) if !released(None) => return Ok(()),
            Err(ReconnectError::GaveUp(e) | ReconnectError::Refused(e)) => return Err(e),
        }
        link.mark_reregistered();
        info!(engine = %engine_id, side_channel = %st.side_channel, "registered again with the node agent");
    }
}

/// The managed-mode [`KvTransfer`]: the node agent READs the owner's blocks
/// into this engine's (registered) memory.
pub struct AgentTransfer {
    reg: Arc<Registration>,
    direction: ReadDirection,
    read_timeout_ms: u64,
    /// Remote engines the agent has connected this engine to, and the
    /// registration epoch they were connected in (a re-registered engine
    /// has no connections at the new agent).
    connected: tokio::sync::Mutex<(u64, HashSet<String>)>,
}

impl AgentTransfer {
    /// A transfer for a reader in `direction` (`D2p` for a P engine, `P2d` for D).
    pub fn new(reg: Arc<Registration>, direction: ReadDirection, read_timeout_ms: u64) -> Self {
        Self {
            reg,
            direction,
            read_timeout_ms,
            connected: tokio::sync::Mutex::new((0, HashSet::new())),
        }
    }

    /// Connects this engine to the owner's side channel through the agent
    /// unless done already; the engine there must be the one the params name.
    async fn ensure_connected(&self, req: &ReadRequest) -> Result<(), TransferError> {
        let mut guard = self.connected.lock().await;
        let epoch = self.reg.epoch();
        if guard.0 != epoch {
            *guard = (epoch, HashSet::new());
        }
        let connected = &mut guard.1;
        if connected.contains(&req.remote_engine_id) {
            return Ok(());
        }
        let addr = resolve_side_channel(&req.remote_host, req.remote_port).await?;
        let engine_id = self.reg.engine_id();
        let peer = self
            .reg
            .link
            .with(async |c| c.connect_remote(engine_id, addr).await)
            .await
            .map_err(|e| TransferError::Transfer(format!("connect to {addr}: {e}")))?;
        if peer != req.remote_engine_id {
            return Err(TransferError::Declined(format!(
                "remote_engine_id `{}`: the side channel at {addr} is engine `{peer}`",
                req.remote_engine_id
            )));
        }
        connected.insert(peer);
        Ok(())
    }
}

impl AgentTransfer {
    /// One managed READ of `req` (lease checked, owner notified).
    async fn read_once(
        &self,
        req: &ReadRequest,
        blocks: Vec<kvloop_dataplane::BlockPair>,
    ) -> Result<(), ClientError> {
        let engine_id = self.reg.engine_id();
        self.reg
            .link
            .with(async |c| {
                c.read(
                    engine_id,
                    &req.remote_engine_id,
                    blocks,
                    self.direction,
                    Some((&req.remote_request_id, 1)),
                    true,
                    Some(self.read_timeout_ms),
                )
                .await
                .map(|_| ())
            })
            .await
    }
}

impl KvTransfer for AgentTransfer {
    fn read(&self, req: ReadRequest) -> ReadFuture<'_> {
        Box::pin(async move {
            let blocks = req.block_pairs()?;
            self.ensure_connected(&req).await?;
            let mut r = self.read_once(&req, blocks.clone()).await;
            if matches!(&r, Err(ClientError::Api(e)) if e.kind == ErrorKind::UnknownPeer) {
                // The agent's connection to the owner closed (the owner's
                // agent restarted): nothing was posted; connect and READ again.
                self.connected.lock().await.1.remove(&req.remote_engine_id);
                self.ensure_connected(&req).await?;
                r = self.read_once(&req, blocks).await;
            }
            match r {
                Ok(()) => Ok(req.num_tokens),
                Err(ClientError::Api(e)) if e.kind == ErrorKind::Lease => {
                    Err(TransferError::Declined(e.to_string()))
                }
                // Timed out at the agent (its destination blocks are
                // quarantined there), or the agent went away mid-READ.
                Err(ClientError::Api(e)) if e.kind == ErrorKind::Timeout => {
                    Err(TransferError::Abandoned(e.to_string()))
                }
                Err(e @ ClientError::Io(_)) => {
                    self.connected.lock().await.1.remove(&req.remote_engine_id);
                    warn!(error = %e, "agent connection failed during a READ");
                    Err(TransferError::Abandoned(e.to_string()))
                }
                Err(e) => {
                    // The owner may have restarted (new layout, new side
                    // channel): connect afresh next time.
                    if !matches!(&e, ClientError::Api(a) if a.kind == ErrorKind::BadRequest) {
                        self.connected.lock().await.1.remove(&req.remote_engine_id);
                    }
                    if let ClientError::Io(_) = e {
                        warn!(error = %e, "agent connection failed during a READ");
                    }
                    Err(TransferError::Transfer(e.to_string()))
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `remote_host` is a host name or an IP literal, as at the router.
    #[tokio::test]
    async fn side_channel_hosts_are_names_or_ip_literals() {
        let a = resolve_side_channel("127.0.0.1", 5600).await.unwrap();
        assert_eq!(a, "127.0.0.1:5600".parse().unwrap());
        for v6 in ["::1", "[::1]"] {
            let a = resolve_side_channel(v6, 5600).await.unwrap();
            assert_eq!(a, "[::1]:5600".parse().unwrap(), "{v6}");
        }
        let a = resolve_side_channel("localhost", 5600).await.unwrap();
        assert!(a.ip().is_loopback() && a.port() == 5600, "{a}");
        match resolve_side_channel("no-such-host.invalid", 5600).await {
            Err(TransferError::Declined(m)) => assert!(m.contains("remote_host"), "{m}"),
            other => panic!("expected a decline naming remote_host, got {other:?}"),
        }
    }
}
