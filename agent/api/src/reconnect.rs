//! Reconnecting to the node agent after it went away (restarted, killed):
//! exponential back-off with jitter (the `backon` crate) around
//! [`AgentClient::connect`].
//!
//! Only connection failures are retried (the socket absent or refusing,
//! the agent closing the connection during the hello): a refusal by a
//! running agent (`version`, `forbidden`) is final and returned at once.
use std::path::Path;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};

use crate::client::{AgentClient, ClientError};

/// Back-off between reconnection attempts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// First delay (default 50 ms).
    pub min_delay: Duration,
    /// Longest delay between two attempts (default 2 s).
    pub max_delay: Duration,
    /// Most attempts after the first; `None` retries until `keep_going`
    /// says stop (default `None`).
    pub max_retries: Option<usize>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            min_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(2),
            max_retries: None,
        }
    }
}

impl Backoff {
    /// The `backon` builder: factor 2, jitter, capped at `max_delay`.
    pub fn builder(&self) -> ExponentialBuilder {
        let b = ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(2.0)
            .with_jitter();
        match self.max_retries {
            Some(n) => b.with_max_times(n),
            None => b.without_max_times(),
        }
    }
}

impl ClientError {
    /// Whether the error means the agent (or the connection to it) is gone,
    /// so that reconnecting may help: socket errors and a connection closed
    /// mid-call. A refusal by a running agent is not.
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, Self::Io(_) | Self::Closed)
    }
}

/// Why [`connect_with_backoff`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReconnectError {
    /// The agent answered and refused (`version`, `forbidden`): final.
    #[error("the agent refused the connection: {0}")]
    Refused(ClientError),
    /// `keep_going` returned `false` (the caller is shutting down) or the
    /// attempts ran out; the last connection error.
    #[error("gave up reconnecting to the agent: {0}")]
    GaveUp(ClientError),
}

/// Connects to the agent at `path`, retrying connection failures with
/// `backoff` while `keep_going()` is true (asked after every failed attempt).
///
/// # Errors
/// [`ReconnectError`].
pub async fn connect_with_backoff(
    path: &Path,
    client_name: &str,
    backoff: &Backoff,
    mut keep_going: impl FnMut() -> bool,
) -> Result<AgentClient, ReconnectError> {
    let attempt = || async { AgentClient::connect(path, client_name).await };
    attempt
        .retry(backoff.builder())
        .when(|e: &ClientError| e.is_connection_lost() && keep_going())
        .notify(|e, delay| {
            tracing::debug!(error = %e, ?delay, path = %path.display(), "agent unreachable; retrying");
        })
        .await
        .map_err(|e| {
            if e.is_connection_lost() {
                ReconnectError::GaveUp(e)
            } else {
                ReconnectError::Refused(e)
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{PROTOCOL_VERSION, Reply, Response, read_frame, send_json};

    fn sock_path(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("kvloop-api-{tag}-{}", std::process::id()))
    }

    /// The agent's socket appears only after a while: the client keeps
    /// trying and connects once it is there.
    #[tokio::test]
    async fn reconnects_once_the_agent_is_back() {
        let path = sock_path("backoff");
        let _ = std::fs::remove_file(&path);
        let p2 = path.clone();
        let server = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let l = tokio::net::UnixListener::bind(&p2).unwrap();
            let (s, _) = l.accept().await.unwrap();
            let _hello = read_frame(&s).await.unwrap();
            let welcome = Response::Ok(Reply::Welcome {
                version: PROTOCOL_VERSION,
                agent_id: "node-a".into(),
            });
            send_json(&s, &welcome, &[]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
        let b = Backoff {
            min_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(50),
            max_retries: None,
        };
        let c = tokio::time::timeout(
            Duration::from_secs(5),
            connect_with_backoff(&path, "t", &b, || true),
        )
        .await
        .expect("connected within 5 s")
        .expect("connected");
        assert_eq!(c.agent_id(), "node-a");
        server.abort();
        let _ = std::fs::remove_file(&path);
    }

    #[tokio::test]
    async fn stops_when_told_and_after_max_retries() {
        let path = sock_path("absent");
        let _ = std::fs::remove_file(&path);
        let b = Backoff {
            min_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(2),
            max_retries: Some(3),
        };
        let mut calls = 0;
        let r = connect_with_backoff(&path, "t", &b, || {
            calls += 1;
            true
        })
        .await;
        assert!(matches!(r, Err(ReconnectError::GaveUp(_))), "{r:?}");
        assert_eq!(calls, 4, "asked after each of the 4 failed attempts");
        let r = connect_with_backoff(&path, "t", &Backoff::default(), || false).await;
        assert!(matches!(r, Err(ReconnectError::GaveUp(_))), "{r:?}");
    }
}
