//! The simulator's link to its node agent (`kvloop-agent`) over the agent's
//! local API (`kvloop-agent-api`: a Unix stream socket, length-prefixed JSON,
//! memfds passed by `SCM_RIGHTS`).
//!
//! - [`AgentLink`]: a pool of connections to the agent. Each connection
//!   carries one request at a time (a managed READ holds its connection for
//!   the READ's duration), so concurrent requests each take their own
//!   connection; a connection whose request failed at the socket level or
//!   was cancelled (its caller's future dropped) is dropped, not reused.
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
//!   engine, which frees the blocks.
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use kvloop_agent_api::client::{AgentClient, ClientError};
use kvloop_agent_api::proto::{EngineEvent, ReadDirection};
use kvloop_dataplane::{HostRegion, KvLayout};
use tracing::warn;

use crate::transfer::{KvTransfer, ReadFuture, ReadRequest, TransferError, host_port};

/// Most idle connections kept in an [`AgentLink`]'s pool.
const MAX_IDLE_CONNECTIONS: usize = 16;

/// A pool of connections to the node agent's local API.
pub struct AgentLink {
    path: PathBuf,
    client_name: String,
    idle: Mutex<Vec<AgentClient>>,
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
        Ok(Self {
            path: path.to_path_buf(),
            client_name: client_name.to_string(),
            idle: Mutex::new(vec![first]),
        })
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
        let idle = self.idle.lock().unwrap().pop();
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
        if matches!(r, Err(ClientError::Io(_) | ClientError::Protocol(_))) {
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

/// An engine's KV memory registered with its node agent (managed mode).
pub struct Registration {
    link: Arc<AgentLink>,
    engine_id: String,
    /// The connection that made the registration: the agent unregisters the
    /// engine when it closes.
    _conn: AgentClient,
    side_channel: SocketAddr,
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
        Ok(Self {
            agent_id: conn.agent_id().to_string(),
            link,
            engine_id: engine_id.to_string(),
            _conn: conn,
            side_channel,
        })
    }

    /// The side-channel address the agent serves this engine's blocks on
    /// (what `kv_transfer_params` carries as `remote_host`/`remote_port`).
    pub fn side_channel(&self) -> SocketAddr {
        self.side_channel
    }

    /// The agent's id (node name).
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// The connection pool.
    pub fn link(&self) -> &Arc<AgentLink> {
        &self.link
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
                c.retain(&self.engine_id, request_id, ids, Some(ttl_ms))
                    .await
                    .map(|_| ())
            })
            .await
    }

    /// Releases the lease of `request_id` (the engine evicts its blocks).
    ///
    /// # Errors
    /// `lease` when nothing is retained.
    pub async fn release(&self, request_id: &str) -> Result<(), ClientError> {
        self.link
            .with(async |c| c.release(&self.engine_id, request_id).await)
            .await
    }
}

/// Waits for the agent's events of `engine_id` on a connection of its own
/// and calls `released(request_id)` for every lease the agent released
/// (all owner notifications received, TTL lapsed, owner release). Returns
/// `Ok` when `released` returns `false` (the engine is gone; checked at
/// least every second), or the error that ended the stream: the agent is
/// gone ([`ClientError::Io`]) or no longer hosts the engine
/// (`unknown_engine`); either way the registration is gone with it.
///
/// # Errors
/// As above.
pub async fn run_events(
    link: Arc<AgentLink>,
    engine_id: String,
    mut released: impl FnMut(Option<&str>) -> bool,
) -> Result<(), ClientError> {
    let c = AgentClient::connect(link.path(), &format!("{engine_id}-events")).await?;
    loop {
        if !released(None) {
            return Ok(());
        }
        for ev in c.events(&engine_id, 1000).await? {
            if let EngineEvent::Released(r) = ev
                && !released(Some(&r.request_id))
            {
                return Ok(());
            }
        }
    }
}

/// The managed-mode [`KvTransfer`]: the node agent READs the owner's blocks
/// into this engine's (registered) memory.
pub struct AgentTransfer {
    reg: Arc<Registration>,
    direction: ReadDirection,
    read_timeout_ms: u64,
    /// Remote engines the agent has connected this engine to.
    connected: tokio::sync::Mutex<HashSet<String>>,
}

impl AgentTransfer {
    /// A transfer for a reader in `direction` (`D2p` for a P engine, `P2d` for D).
    pub fn new(reg: Arc<Registration>, direction: ReadDirection, read_timeout_ms: u64) -> Self {
        Self {
            reg,
            direction,
            read_timeout_ms,
            connected: tokio::sync::Mutex::new(HashSet::new()),
        }
    }

    /// Connects this engine to the owner's side channel through the agent
    /// unless done already; the engine there must be the one the params name.
    async fn ensure_connected(&self, req: &ReadRequest) -> Result<(), TransferError> {
        let mut connected = self.connected.lock().await;
        if connected.contains(&req.remote_engine_id) {
            return Ok(());
        }
        let hp = host_port(&req.remote_host, req.remote_port);
        let addr: SocketAddr = hp.parse().map_err(|_| {
            TransferError::Declined(format!(
                "remote_host/remote_port `{hp}`: expected an IP address and port (the owner's side channel)"
            ))
        })?;
        let engine_id = &self.reg.engine_id;
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

impl KvTransfer for AgentTransfer {
    fn read(&self, req: ReadRequest) -> ReadFuture<'_> {
        Box::pin(async move {
            let blocks = req.block_pairs()?;
            self.ensure_connected(&req).await?;
            let engine_id = &self.reg.engine_id;
            let r = self
                .reg
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
                })
                .await;
            match r {
                Ok(_) => Ok(req.num_tokens),
                Err(ClientError::Api(e)) if e.kind == "lease" => {
                    Err(TransferError::Declined(e.to_string()))
                }
                Err(e) => {
                    // The owner may have restarted (new layout, new side
                    // channel): connect afresh next time.
                    if !matches!(&e, ClientError::Api(a) if a.kind == "bad_request") {
                        self.connected.lock().await.remove(&req.remote_engine_id);
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
