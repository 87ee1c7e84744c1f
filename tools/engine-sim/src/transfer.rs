//! The KV side of an engine: one READ of a remote engine's blocks
//! ([`ReadRequest`], [`KvTransfer`], [`TransferError`]), the simulated
//! transfer, and the client end of the emitter's HTTP side channel
//! (`POST /kv/read`, served by [`crate::side_channel`]).
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use serde_json::{Value, json};

/// One READ a reader asks its [`KvTransfer`] to perform.
#[derive(Debug, Clone)]
pub struct ReadRequest {
    /// The reader's engine id.
    pub reader_engine_id: String,
    /// Emitter's engine id.
    pub remote_engine_id: String,
    /// Emitter's side-channel host (possibly a bracketed IPv6 literal).
    pub remote_host: String,
    /// Emitter's side-channel port.
    pub remote_port: u16,
    /// Emitter's request id (owner of the blocks).
    pub remote_request_id: String,
    /// Emitter's block ids, flattened over KV-cache groups.
    pub remote_block_ids: Vec<u32>,
    /// Tokens to read.
    pub num_tokens: u64,
    /// The reader's destination blocks: the first `ceil(num_tokens / block_size_tokens)`
    /// blocks of the reader's allocation for this request.
    pub local_block_ids: Vec<u32>,
    /// Tokens per block (the reader's; the sim assumes both sides agree).
    pub block_size_tokens: u32,
}

impl ReadRequest {
    /// The (remote, local) block pairs of the first
    /// `ceil(num_tokens / block_size_tokens)` blocks on each side.
    ///
    /// # Errors
    /// [`TransferError::Declined`] when either side lists fewer blocks.
    pub fn block_pairs(&self) -> Result<Vec<kvloop_dataplane::BlockPair>, TransferError> {
        let bs = u64::from(self.block_size_tokens.max(1));
        let n_blocks = self.num_tokens.div_ceil(bs) as usize;
        if self.remote_block_ids.len() < n_blocks || self.local_block_ids.len() < n_blocks {
            return Err(TransferError::Declined(format!(
                "{} tokens need {n_blocks} blocks; remote_block_ids has {}, local {}",
                self.num_tokens,
                self.remote_block_ids.len(),
                self.local_block_ids.len()
            )));
        }
        Ok(self.remote_block_ids[..n_blocks]
            .iter()
            .zip(&self.local_block_ids[..n_blocks])
            .map(|(r, l)| kvloop_dataplane::BlockPair {
                remote: u64::from(*r),
                local: u64::from(*l),
            })
            .collect())
    }
}

/// Why a READ was not done (the reader then recomputes).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The emitter no longer holds the blocks (read already, expired, unknown).
    #[error("emitter declined the READ: {0}")]
    Declined(String),
    /// Side channel unreachable or broken.
    #[error("side channel: {0}")]
    SideChannel(String),
    /// The READ itself failed (connect, bounds, backend) before or without
    /// writing the destination blocks.
    #[error("READ failed: {0}")]
    Transfer(String),
    /// The READ was abandoned while posted (it timed out, or the agent
    /// connection broke mid-READ): the provider may still write the
    /// destination blocks, so they must be neither computed into nor served
    /// ([`crate::Engine`] parks them, see `Engine::park_blocks`).
    #[error("READ abandoned: {0}")]
    Abandoned(String),
}

impl TransferError {
    /// The destination blocks may still be written.
    pub fn may_still_write(&self) -> bool {
        matches!(self, TransferError::Abandoned(_))
    }
}

/// Boxed future returned by [`KvTransfer::read`].
pub type ReadFuture<'a> = Pin<Box<dyn Future<Output = Result<u64, TransferError>> + Send + 'a>>;

/// The KV side of an engine: performs one READ of a remote engine's blocks and
/// notifies the owner. Returns the tokens read. A managed-mode implementation
/// asks the node agent to do the READ.
pub trait KvTransfer: Send + Sync + 'static {
    /// Read `req.num_tokens` tokens of KV from the emitter and notify it.
    fn read(&self, req: ReadRequest) -> ReadFuture<'_>;
}

/// Simulated transfer: checks the emitter's lease over its side channel (which
/// also acts as the read notification, freeing the blocks), then sleeps
/// `transfer_us_per_token × tokens`.
pub struct SimulatedTransfer {
    http: reqwest::Client,
    transfer_us_per_token: u64,
}

impl SimulatedTransfer {
    /// A transfer with the given per-token cost (microseconds).
    pub fn new(transfer_us_per_token: u64) -> Self {
        Self {
            http: side_channel_http(),
            transfer_us_per_token,
        }
    }
}

/// `host:port` with IPv6 literals bracketed (idempotent for bracketed input).
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl KvTransfer for SimulatedTransfer {
    fn read(&self, req: ReadRequest) -> ReadFuture<'_> {
        Box::pin(async move {
            claim_on_side_channel(&self.http, &req, false).await?;
            sleep_us(self.transfer_us_per_token * req.num_tokens).await;
            Ok(req.num_tokens)
        })
    }
}

/// An HTTP client for side-channel claims (no Nagle delay).
pub(crate) fn side_channel_http() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .expect("http client")
}

/// Claims the emitter's held blocks on its side channel (`POST /kv/read`):
/// the emitter checks that the hold exists, covers the blocks and tokens and
/// does not expire within its margin. With `defer_release` it keeps the
/// blocks until the reader's owner notification and answers with its
/// transfer engine's address; without, the claim itself frees them.
/// Returns the emitter's JSON answer (null when it has no body).
///
/// # Errors
/// [`TransferError::SideChannel`] when unreachable or the answer is not
/// JSON; [`TransferError::Declined`] when the emitter refuses.
pub(crate) async fn claim_on_side_channel(
    http: &reqwest::Client,
    req: &ReadRequest,
    defer_release: bool,
) -> Result<Value, TransferError> {
    let url = format!(
        "http://{}/kv/read",
        host_port(&req.remote_host, req.remote_port)
    );
    let body = json!({
        "remote_request_id": req.remote_request_id,
        "remote_engine_id": req.remote_engine_id,
        "block_ids": req.remote_block_ids,
        "num_tokens": req.num_tokens,
        "reader_engine_id": req.reader_engine_id,
        "defer_release": defer_release,
    });
    let resp = http
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| TransferError::SideChannel(format!("{url}: {e}")))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(TransferError::Declined(format!("{status}: {text}")));
    }
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| TransferError::SideChannel(format!("{url}: reply: {e}")))?;
    if bytes.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| TransferError::SideChannel(format!("{url}: reply: {e}")))
}

/// Sleep `us` microseconds; no timer at all for 0 (a zero-length tokio sleep
/// still waits for the next timer tick, about 1 ms).
pub(crate) async fn sleep_us(us: u64) {
    if us > 0 {
        tokio::time::sleep(Duration::from_micros(us)).await;
    }
}

/// The owner's side channel from the params' `remote_host` and
/// `remote_port`: `remote_host` is a host name or an IP literal (IPv6 with or
/// without brackets), the same contract as the router's registry; a name is
/// resolved here (the first address).
///
/// # Errors
/// [`TransferError::Declined`] naming `remote_host` when it neither parses
/// nor resolves.
pub async fn resolve_side_channel(host: &str, port: u16) -> Result<SocketAddr, TransferError> {
    let hp = host_port(host, port);
    if let Ok(a) = hp.parse::<SocketAddr>() {
        return Ok(a);
    }
    let declined = |why: String| {
        TransferError::Declined(format!(
            "remote_host `{host}`: expected a host name or IP literal of the owner's side channel ({why})"
        ))
    };
    match tokio::net::lookup_host(&hp).await {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| declined("the name has no address".into())),
        Err(e) => Err(declined(format!("resolving `{hp}`: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_hosts_are_bracketed_once() {
        assert_eq!(host_port("::1", 5), "[::1]:5");
        assert_eq!(host_port("[::1]", 5), "[::1]:5");
        assert_eq!(host_port("10.0.0.1", 5), "10.0.0.1:5");
    }
}
