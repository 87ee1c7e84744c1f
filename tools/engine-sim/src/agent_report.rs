//! Prefill reports to the node agent (`kvloop-agent`) over its local API: a
//! Unix stream socket carrying frames of a 4-byte little-endian length and a
//! JSON body (`agent/src/proto.rs`: `{"op": "hello", ...}` then
//! `{"op": "record_prefill", ...}`; replies `{"ok": {...}}` or
//! `{"err": {...}}`). Only the two requests the simulator needs, so the
//! engine does not link the agent crate.
use std::path::Path;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::Mutex;

/// Protocol version of the agent's local API this client speaks.
pub const AGENT_PROTOCOL_VERSION: u32 = 1;
/// Largest reply accepted, bytes.
const MAX_REPLY_BYTES: usize = 1 << 20;

/// A connection to the local agent (one request at a time).
pub struct AgentReporter {
    sock: Mutex<UnixStream>,
}

impl AgentReporter {
    /// Connects and says hello.
    ///
    /// # Errors
    /// Socket errors, or the agent's refusal (message included).
    pub async fn connect(path: &Path, client: &str) -> std::io::Result<Self> {
        let me = Self {
            sock: Mutex::new(UnixStream::connect(path).await?),
        };
        me.call(&json!({"op": "hello", "version": AGENT_PROTOCOL_VERSION, "client": client}))
            .await?;
        Ok(me)
    }

    /// Sends one request; returns the `ok` reply.
    ///
    /// # Errors
    /// Socket errors; `InvalidData` for an `err` reply (with its message)
    /// or an unreadable one.
    pub async fn call(&self, req: &Value) -> std::io::Result<Value> {
        let body = serde_json::to_vec(req).map_err(std::io::Error::other)?;
        let mut s = self.sock.lock().await;
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        s.write_all(&frame).await?;
        let mut head = [0u8; 4];
        s.read_exact(&mut head).await?;
        let len = u32::from_le_bytes(head) as usize;
        if len > MAX_REPLY_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("agent reply of {len} bytes: at most {MAX_REPLY_BYTES}"),
            ));
        }
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).await?;
        let v: Value = serde_json::from_slice(&buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        match (v.get("ok"), v.get("err")) {
            (Some(ok), _) => Ok(ok.clone()),
            (_, Some(err)) => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("agent refused: {err}"),
            )),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("agent reply without ok/err: {v}"),
            )),
        }
    }

    /// Reports one prefill: `prompt_tokens` in all, `reused_tokens` of them
    /// READ instead of computed, `latency_us` from arrival to the first token.
    ///
    /// # Errors
    /// As [`AgentReporter::call`].
    pub async fn record_prefill(
        &self,
        engine_id: &str,
        prompt_tokens: u64,
        reused_tokens: u64,
        latency_us: u64,
    ) -> std::io::Result<()> {
        self.call(&json!({
            "op": "record_prefill",
            "engine_id": engine_id,
            "prompt_tokens": prompt_tokens,
            "reused_tokens": reused_tokens,
            "latency_us": latency_us,
        }))
        .await
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake agent on a socket pair: answers hello and one report.
    #[tokio::test]
    async fn frames_and_replies() {
        let dir = std::env::temp_dir().join(format!("kvloop-sim-agent-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let l = tokio::net::UnixListener::bind(&dir).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut seen = Vec::new();
            for reply in [
                json!({"ok": {"reply": "welcome", "version": 1, "agent_id": "a"}}),
                json!({"err": {"kind": "bad_request", "message": "prompt_tokens: expected > 0"}}),
            ] {
                let mut head = [0u8; 4];
                s.read_exact(&mut head).await.unwrap();
                let mut b = vec![0u8; u32::from_le_bytes(head) as usize];
                s.read_exact(&mut b).await.unwrap();
                seen.push(serde_json::from_slice::<Value>(&b).unwrap());
                let out = serde_json::to_vec(&reply).unwrap();
                s.write_all(&(out.len() as u32).to_le_bytes())
                    .await
                    .unwrap();
                s.write_all(&out).await.unwrap();
            }
            seen
        });
        let c = AgentReporter::connect(&dir, "p0").await.unwrap();
        let e = c.record_prefill("p0", 0, 0, 5).await.unwrap_err();
        assert!(e.to_string().contains("prompt_tokens"), "{e}");
        let seen = server.await.unwrap();
        assert_eq!(seen[0]["op"], "hello");
        assert_eq!(seen[1]["op"], "record_prefill");
        assert_eq!(seen[1]["latency_us"], 5);
        let _ = std::fs::remove_file(&dir);
    }
}
