//! `kvloop explain --pair P,D`: asks a kvloop agent (`GET /v1/explain` on
//! its HTTP address) why pair (P, D) has its recompute threshold: the
//! threshold, the fitted transfer and prefill models, the samples behind
//! them and the history of changes with their reasons.
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Arguments of `kvloop explain`.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The pair: `<prefill engine id>,<decode engine id>`.
    #[arg(long)]
    pub pair: String,
    /// The agent's HTTP address (its `http_listen`), on the prefill engine's node.
    #[arg(long, env = "KVLOOP_AGENT_HTTP", default_value = "127.0.0.1:9470")]
    pub agent: String,
    /// Print the structured explanation as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Percent-encodes a query value (RFC 3986 unreserved characters kept).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b',' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A plain HTTP/1.1 GET (the agent answers with a `Content-Length` body);
/// returns (status, body).
fn get(addr: &str, path: &str) -> Result<(u16, String)> {
    let host = addr.trim_start_matches("http://").trim_end_matches('/');
    let sa = host
        .to_socket_addrs()
        .with_context(|| format!("--agent `{addr}`: expected host:port"))?
        .next()
        .with_context(|| format!("--agent `{addr}`: no address"))?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(3))
        .with_context(|| format!("connecting to the agent at {sa}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .context("reading the agent's answer")?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("malformed HTTP answer from the agent")?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("malformed HTTP status line")?;
    Ok((status, body.to_string()))
}

/// Runs `kvloop explain`.
///
/// # Errors
/// The agent is unreachable, or refuses the pair (the message says why).
pub fn run(a: ExplainArgs) -> Result<()> {
    if a.pair.split(',').filter(|s| !s.trim().is_empty()).count() != 2 {
        bail!(
            "--pair `{}`: expected `<prefill engine id>,<decode engine id>`",
            a.pair
        );
    }
    let (status, body) = get(&a.agent, &format!("/v1/explain?pair={}", encode(&a.pair)))?;
    let v: serde_json::Value = serde_json::from_str(&body)
        .with_context(|| format!("agent answered HTTP {status} with a non-JSON body: {body}"))?;
    if status != 200 {
        bail!(
            "agent: {}",
            v.get("message").and_then(|m| m.as_str()).unwrap_or(&body)
        );
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v["explain"])?);
    } else {
        print!("{}", v["text"].as_str().unwrap_or_default());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn encodes_query_values() {
        assert_eq!(super::encode("p0,d 0/x"), "p0,d%200%2Fx");
    }
}
