//! Issue 12 item 10: garbage on the agent's Unix socket and HTTP port
//! (random bytes, `0xFFFFFFFF` length prefixes, truncated frames, 20 MB
//! bodies). The agent keeps serving, answers with an error frame where the
//! framing allows one, and logs at warn with the peer's pid and uid.
use std::process::Command;
use std::time::Duration;

use kvloop_agent::client::AgentClient;
use kvloop_agent::proto::{Reply, Response, read_frame};
use kvloop_cli::child::ReadyChild;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

fn free_port() -> u16 {
    kvloop_tests::free_port("127.0.0.1")
}

/// Reads one response frame; `None` when the agent closed without one.
async fn response(s: &UnixStream) -> Option<Response> {
    let f = tokio::time::timeout(Duration::from_secs(5), read_frame(s))
        .await
        .expect("an answer or a close within 5 s");
    match f {
        Ok(Some((body, _))) => Some(serde_json::from_slice(&body).expect("a JSON response")),
        _ => None,
    }
}

fn expect_bad_request(r: Option<Response>, what: &str, needle: &str) {
    match r {
        Some(Response::Err(e)) => {
            assert_eq!(e.kind.as_str(), "bad_request", "{what}: {e}");
            assert!(e.message.contains(needle), "{what}: {e}");
        }
        other => panic!("{what}: expected an error frame, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_answered_logged_and_the_agent_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let http = free_port();
    let sock = dir.path().join("g.sock");
    let cfg = dir.path().join("g.toml");
    std::fs::write(
        &cfg,
        format!(
            "agent_id = \"g\"\nnode_addr = \"127.0.0.1\"\nhttp_listen = \"127.0.0.1:{http}\"\n\
             socket_path = \"{}\"\nbackend = {{ kind = \"libfabric\", provider = \"tcp;ofi_rxm\" }}\n\
             [probe]\nenabled = false\n",
            sock.display()
        ),
    )
    .unwrap();
    let log = dir.path().join("agent.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvloop-agent"));
    cmd.arg("--config").arg(&cfg).env("RUST_LOG", "warn");
    let _agent = ReadyChild::start("kvloop-agent", cmd, Some(&log), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));

    // A 0xFFFFFFFF length prefix: an error frame, then the close.
    let mut s = UnixStream::connect(&sock).await.unwrap();
    s.write_all(&[0xFF; 4]).await.unwrap();
    expect_bad_request(response(&s).await, "0xFFFFFFFF prefix", "at most");
    assert!(response(&s).await.is_none(), "closed after a lost framing");

    // A 20 MB body: refused by its prefix the same way.
    let mut s = UnixStream::connect(&sock).await.unwrap();
    s.write_all(&(20u32 << 20).to_le_bytes()).await.unwrap();
    let _ = s.write_all(&vec![b'x'; 1 << 20]).await;
    expect_bad_request(response(&s).await, "20 MB body", "at most");

    // A frame cut short (the client stops writing inside the body).
    let mut s = UnixStream::connect(&sock).await.unwrap();
    s.write_all(&100u32.to_le_bytes()).await.unwrap();
    s.write_all(b"{\"op\":").await.unwrap();
    s.shutdown().await.unwrap();
    expect_bad_request(response(&s).await, "truncated frame", "inside a frame");

    // A well-framed body that is not a request: answered, and the
    // connection goes on (a hello on it is welcomed).
    let mut s = UnixStream::connect(&sock).await.unwrap();
    let junk = b"\x00\x01garbage\xfe";
    s.write_all(&(junk.len() as u32).to_le_bytes())
        .await
        .unwrap();
    s.write_all(junk).await.unwrap();
    expect_bad_request(response(&s).await, "junk body", "request");
    let hello = br#"{"op":"hello","version":1,"client":"g"}"#;
    s.write_all(&(hello.len() as u32).to_le_bytes())
        .await
        .unwrap();
    s.write_all(hello).await.unwrap();
    assert!(
        matches!(
            response(&s).await,
            Some(Response::Ok(Reply::Welcome { .. }))
        ),
        "the connection still serves after a bad body"
    );

    // Random bytes (a fixed LCG stream), several connections.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..8 {
        let mut s = UnixStream::connect(&sock).await.unwrap();
        let bytes: Vec<u8> = (0..4096)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        let _ = s.write_all(&bytes).await;
        let _ = s.shutdown().await;
        let _ = response(&s).await;
    }

    // HTTP: a 20 MB body and raw garbage.
    let c = reqwest::Client::new();
    let r = c
        .post(format!("http://127.0.0.1:{http}/v1/leases/renew"))
        .body(vec![b'x'; 20 << 20])
        .send()
        .await;
    if let Ok(r) = r {
        assert!(r.status().is_client_error(), "{}", r.status());
    }
    let mut t = tokio::net::TcpStream::connect(("127.0.0.1", http))
        .await
        .unwrap();
    let _ = t.write_all(b"\xff\xfe GARBAGE \r\n\r\n").await;
    drop(t);

    // Still serving, both ways.
    let client = AgentClient::connect(&sock, "after").await.unwrap();
    client.status().await.unwrap();
    let ok = c
        .get(format!("http://127.0.0.1:{http}/healthz"))
        .send()
        .await
        .unwrap();
    assert!(ok.status().is_success());

    // Logged at warn with the peer's pid and uid.
    let text = std::fs::read_to_string(&log).unwrap();
    let warns: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("garbage"))
        .collect();
    assert!(!warns.is_empty(), "no garbage warning in the log:\n{text}");
    let own_pid = std::process::id().to_string();
    assert!(
        warns
            .iter()
            .any(|l| l.contains("peer_pid") && l.contains(&own_pid) && l.contains("peer_uid")),
        "warnings name the peer's pid {own_pid} and uid:\n{}",
        warns.join("\n")
    );
    // Rate-limited: 5 per 10 s, however much garbage came.
    assert!(warns.len() <= 5, "{}", warns.join("\n"));
}
