//! Client of the agent's local API, for engines in managed mode (used by
//! `tools/engine-sim` and by a vLLM-side connector).
//!
//! ```no_run
//! # async fn f() -> Result<(), kvloop_agent_api::client::ClientError> {
//! use kvloop_agent_api::client::AgentClient;
//! use kvloop_agent_api::proto::ReadDirection;
//! use kvloop_kv_types::{BlockPair, HostRegion, KvLayout};
//!
//! let layout = KvLayout { num_regions: 2, num_blocks: 64, block_len_bytes: 65536, block_size_tokens: 16 };
//! // The engine owns its KV memory as memfds and keeps using it; the agent maps the same pages.
//! let regions: Vec<HostRegion> = (0..2)
//!     .map(|i| HostRegion::new(&format!("kv{i}"), layout.region_len_bytes() as usize).unwrap())
//!     .collect();
//! let c = AgentClient::connect("/run/kvloop/agent.sock", "my-engine").await?;
//! let side_channel = c.register_memfd("p0", layout, &regions, None).await?;   // goes into kv_transfer_params
//! c.connect_remote("p0", "10.0.0.2:5600".parse().unwrap()).await?;            // D's remote_host:remote_port
//! // D→P: read D's retained blocks 3,4 into our blocks 0,1; notify D "req-7:1"; check D's lease first.
//! let done = c.read("p0", "d0", vec![BlockPair { remote: 3, local: 0 }, BlockPair { remote: 4, local: 1 }],
//!                   ReadDirection::D2p, Some(("req-7", 1)), true, None).await?;
//! println!("{} bytes in {} µs", done.bytes, done.elapsed_us);
//! # Ok(()) }
//! ```
//!
//! One request at a time per connection (requests are serialized by an
//! internal lock). [`AgentClient::events`] waits on the connection, so use a
//! second client for a long-polling event loop.
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use kvloop_kv_types::{BlockPair, HostRegion, KvLayout, OwnerNotify};
use tokio::net::UnixStream;
use tokio::sync::Mutex;

use crate::lease::LeaseInfo;
use crate::proto::{
    ApiError, EngineEvent, PROTOCOL_VERSION, ReadDirection, ReadDone, RegionSource, Reply, Request,
    Response, decode_response, read_frame, send_json,
};

/// Errors of [`AgentClient`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Socket I/O (agent not running, connection cut).
    #[error("agent socket: {0}")]
    Io(#[from] std::io::Error),
    /// The agent refused the request (the message names the bad field).
    #[error("agent: {0}")]
    Api(#[from] ApiError),
    /// The agent closed the connection before answering (it exited or
    /// was killed): reconnect ([`crate::reconnect`]).
    #[error("agent closed the connection")]
    Closed,
    /// The agent answered something unexpected.
    #[error("agent protocol: {0}")]
    Protocol(String),
}

/// A connection to the local agent.
#[derive(Debug)]
pub struct AgentClient {
    sock: Mutex<UnixStream>,
    agent_id: String,
    /// A request was sent and its response not yet read: set while a call
    /// is in progress. Still set when a call starts means an earlier call
    /// was cancelled mid-way (its future dropped), so the next frame on the
    /// socket would be that call's response: the connection is unusable.
    in_flight: AtomicBool,
}

impl AgentClient {
    /// Connects to the agent's socket and says hello (protocol version check).
    ///
    /// # Errors
    /// [`ClientError::Io`] when the socket is absent; [`ClientError::Api`]
    /// (`version`, `forbidden`) when the agent refuses.
    pub async fn connect(path: impl AsRef<Path>, client_name: &str) -> Result<Self, ClientError> {
        let s = UnixStream::connect(path.as_ref()).await?;
        let me = Self {
            sock: Mutex::new(s),
            agent_id: String::new(),
            in_flight: AtomicBool::new(false),
        };
        match me
            .call(
                &Request::Hello {
                    version: PROTOCOL_VERSION,
                    client: client_name.into(),
                },
                &[],
            )
            .await?
        {
            Reply::Welcome { agent_id, .. } => Ok(Self { agent_id, ..me }),
            other => Err(ClientError::Protocol(format!(
                "expected welcome, got {other:?}"
            ))),
        }
    }

    /// Whether an earlier call was cancelled before its response (every
    /// further call fails; drop this client). Meaningful between calls.
    pub fn is_poisoned(&self) -> bool {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The agent's id (node name).
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// Sends one request (with fds) and waits for its response.
    ///
    /// Cancel safety: dropping the returned future mid-way leaves the
    /// connection out of step with the agent; every later call on this
    /// client then fails with [`ClientError::Io`] (connect a new client).
    ///
    /// # Errors
    /// See [`ClientError`].
    pub async fn call(&self, req: &Request, fds: &[RawFd]) -> Result<Reply, ClientError> {
        let s = self.sock.lock().await;
        if self.in_flight.swap(true, Ordering::AcqRel) {
            return Err(ClientError::Io(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "an earlier request on this connection was cancelled before its response; reconnect",
            )));
        }
        send_json(&s, req, fds).await?;
        let (body, _) = read_frame(&s).await?.ok_or(ClientError::Closed)?;
        self.in_flight.store(false, Ordering::Release);
        match decode_response(&body)
            .map_err(|e| ClientError::Protocol(format!("bad response: {e}")))?
        {
            Response::Ok(r) => Ok(r),
            Response::Err(e) => Err(ClientError::Api(e)),
        }
    }

    /// Registers host KV memory: one memfd-backed [`HostRegion`] per layout
    /// region (their fds are passed with `SCM_RIGHTS`; the engine keeps its
    /// own mapping). Returns the engine's side-channel address on the node.
    /// The registration lasts while this client (its connection) lives.
    ///
    /// # Errors
    /// `bad_request` (region count/length vs layout), `dataplane`.
    pub async fn register_memfd(
        &self,
        engine_id: &str,
        layout: KvLayout,
        regions: &[HostRegion],
        side_channel_port: Option<u16>,
    ) -> Result<SocketAddr, ClientError> {
        let fds: Vec<BorrowedFd<'_>> = regions.iter().map(|r| r.fd()).collect();
        let lens: Vec<u64> = regions.iter().map(|r| r.len() as u64).collect();
        self.register_fds(engine_id, layout, &fds, lens, side_channel_port)
            .await
    }

    /// Registers memfd-backed KV memory given as file descriptors (one per
    /// layout region, `len_bytes[i]` the length to map of `fds[i]`), e.g.
    /// again after the agent restarted ([`crate::reconnect`]).
    ///
    /// # Errors
    /// As [`AgentClient::register_memfd`].
    pub async fn register_fds(
        &self,
        engine_id: &str,
        layout: KvLayout,
        fds: &[BorrowedFd<'_>],
        len_bytes: Vec<u64>,
        side_channel_port: Option<u16>,
    ) -> Result<SocketAddr, ClientError> {
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let req = Request::Register {
            engine_id: engine_id.into(),
            layout,
            regions: RegionSource::Memfd { len_bytes },
            side_channel_port,
        };
        match self.call(&req, &raw).await? {
            Reply::Registered { side_channel, .. } => Ok(side_channel),
            other => Err(unexpected(other)),
        }
    }

    /// Unregisters an engine.
    ///
    /// # Errors
    /// `unknown_engine`.
    pub async fn unregister(&self, engine_id: &str) -> Result<(), ClientError> {
        self.call(
            &Request::Unregister {
                engine_id: engine_id.into(),
            },
            &[],
        )
        .await
        .map(|_| ())
    }

    /// Connects a registered engine to a remote engine's side channel;
    /// returns the remote engine id.
    ///
    /// # Errors
    /// `unknown_engine`, `dataplane` (handshake refused, layout mismatch).
    pub async fn connect_remote(
        &self,
        engine_id: &str,
        remote: SocketAddr,
    ) -> Result<String, ClientError> {
        match self
            .call(
                &Request::Connect {
                    engine_id: engine_id.into(),
                    remote,
                },
                &[],
            )
            .await?
        {
            Reply::Connected { peer_engine_id } => Ok(peer_engine_id),
            other => Err(unexpected(other)),
        }
    }

    /// READs `blocks` (remote → local) of `peer_engine_id` into
    /// `engine_id`'s memory. `notify = Some((owner_request_id, count))`
    /// notifies the owner after success; `check_lease` renews the owner's
    /// lease first and declines (error kind `lease`) when the blocks expire
    /// within the safety margin: recompute then.
    ///
    /// # Errors
    /// `lease`, `dataplane` (timeout, bounds), `unknown_engine`.
    #[allow(clippy::too_many_arguments)]
    pub async fn read(
        &self,
        engine_id: &str,
        peer_engine_id: &str,
        blocks: Vec<BlockPair>,
        direction: ReadDirection,
        notify: Option<(&str, u32)>,
        check_lease: bool,
        timeout_ms: Option<u64>,
    ) -> Result<ReadDone, ClientError> {
        let req = Request::Read {
            engine_id: engine_id.into(),
            peer_engine_id: peer_engine_id.into(),
            blocks,
            direction,
            notify: notify.map(|(r, c)| OwnerNotify {
                owner_request_id: r.into(),
                count: c,
            }),
            check_lease,
            timeout_ms,
        };
        match self.call(&req, &[]).await? {
            Reply::ReadDone(o) => Ok(o),
            other => Err(unexpected(other)),
        }
    }

    /// Sends an owner notification without a READ.
    ///
    /// # Errors
    /// `unknown_engine`, `dataplane`.
    pub async fn notify(
        &self,
        engine_id: &str,
        peer_engine_id: &str,
        owner_request_id: &str,
        count: u32,
    ) -> Result<(), ClientError> {
        self.call(
            &Request::Notify {
                engine_id: engine_id.into(),
                peer_engine_id: peer_engine_id.into(),
                owner_request_id: owner_request_id.into(),
                count,
            },
            &[],
        )
        .await
        .map(|_| ())
    }

    /// Retains blocks of a request under a TTL (ms; `None` = the agent's default).
    ///
    /// # Errors
    /// `bad_request` naming the field, `unknown_engine`.
    pub async fn retain(
        &self,
        engine_id: &str,
        request_id: &str,
        block_ids: Vec<u64>,
        ttl_ms: Option<u64>,
    ) -> Result<LeaseInfo, ClientError> {
        match self
            .call(
                &Request::Retain {
                    engine_id: engine_id.into(),
                    request_id: request_id.into(),
                    block_ids,
                    ttl_ms,
                },
                &[],
            )
            .await?
        {
            Reply::Lease(l) => Ok(l),
            other => Err(unexpected(other)),
        }
    }

    /// Renews (as a reader) the lease of `peer_engine_id`'s request.
    ///
    /// # Errors
    /// `lease` when unknown or expiring within the safety margin.
    pub async fn renew(
        &self,
        peer_engine_id: &str,
        request_id: &str,
        lease_ms: u64,
    ) -> Result<LeaseInfo, ClientError> {
        match self
            .call(
                &Request::Renew {
                    peer_engine_id: peer_engine_id.into(),
                    request_id: request_id.into(),
                    lease_ms,
                },
                &[],
            )
            .await?
        {
            Reply::Lease(l) => Ok(l),
            other => Err(unexpected(other)),
        }
    }

    /// Releases retained blocks (owner).
    ///
    /// # Errors
    /// `lease` when nothing is retained; `lease_in_use` while a reader that
    /// renewed the lease is still reading (keep the blocks).
    pub async fn release(&self, engine_id: &str, request_id: &str) -> Result<(), ClientError> {
        self.call(
            &Request::Release {
                engine_id: engine_id.into(),
                request_id: request_id.into(),
            },
            &[],
        )
        .await
        .map(|_| ())
    }

    /// Waits up to `timeout_ms` for events of a hosted engine (owner
    /// notifications, releases).
    ///
    /// # Errors
    /// `unknown_engine`.
    pub async fn events(
        &self,
        engine_id: &str,
        timeout_ms: u64,
    ) -> Result<Vec<EngineEvent>, ClientError> {
        match self
            .call(
                &Request::Events {
                    engine_id: engine_id.into(),
                    timeout_ms,
                    max: 1024,
                },
                &[],
            )
            .await?
        {
            Reply::Events { events } => Ok(events),
            other => Err(unexpected(other)),
        }
    }

    /// Reports a prefill timing (µs) to the cost model.
    ///
    /// # Errors
    /// `bad_request` naming the field.
    pub async fn record_prefill(
        &self,
        engine_id: &str,
        prompt_tokens: u64,
        reused_tokens: u64,
        latency_us: u64,
    ) -> Result<(), ClientError> {
        self.call(
            &Request::RecordPrefill {
                engine_id: engine_id.into(),
                prompt_tokens,
                reused_tokens,
                latency_us,
            },
            &[],
        )
        .await
        .map(|_| ())
    }

    /// The explanation of a pair's threshold: (text, JSON).
    ///
    /// # Errors
    /// `bad_request` for an unknown pair.
    pub async fn explain(
        &self,
        prefill: &str,
        decode: &str,
    ) -> Result<(String, serde_json::Value), ClientError> {
        match self
            .call(
                &Request::Explain {
                    prefill_engine_id: prefill.into(),
                    decode_engine_id: decode.into(),
                },
                &[],
            )
            .await?
        {
            Reply::Explain { text, explain } => Ok((text, explain)),
            other => Err(unexpected(other)),
        }
    }

    /// Agent status JSON.
    ///
    /// # Errors
    /// Socket errors.
    pub async fn status(&self) -> Result<serde_json::Value, ClientError> {
        match self.call(&Request::Status, &[]).await? {
            Reply::Status(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }
}

fn unexpected(r: Reply) -> ClientError {
    ClientError::Protocol(format!("unexpected reply {r:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake agent that welcomes the client, then reads one request and
    /// never answers it.
    #[tokio::test]
    async fn a_cancelled_call_poisons_the_connection_instead_of_misrouting_replies() {
        let path = std::env::temp_dir().join(format!("kvloop-api-cancel-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let l = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let _hello = read_frame(&s).await.unwrap();
            let welcome = Response::Ok(Reply::Welcome {
                version: PROTOCOL_VERSION,
                agent_id: "node-a".into(),
            });
            send_json(&s, &welcome, &[]).await.unwrap();
            let _status = read_frame(&s).await.unwrap();
            // Answer late: this reply must never be taken for another call's.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let _ = send_json(&s, &Response::Ok(Reply::Done), &[]).await;
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        });
        let c = AgentClient::connect(&path, "test").await.unwrap();
        assert_eq!(c.agent_id(), "node-a");
        let cancelled =
            tokio::time::timeout(std::time::Duration::from_millis(50), c.status()).await;
        assert!(cancelled.is_err(), "the call should still be waiting");
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        match c.status().await {
            Err(ClientError::Io(e)) => assert!(e.to_string().contains("cancelled"), "{e}"),
            other => panic!("expected an Io error, got {other:?}"),
        }
        server.abort();
        let _ = std::fs::remove_file(&path);
    }
}
