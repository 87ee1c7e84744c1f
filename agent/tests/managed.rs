//! Managed mode through two real agents on loopback: this test process is
//! the engine of both nodes (a prefill engine `p0` registered with agent A,
//! a decode engine `d0` with agent B), passing its memfd KV memory over the
//! Unix sockets. READs in both directions land byte-exact in the engine's
//! own mapping; owner notifications release leases; an expiring lease
//! declines the READ; a second agent process exits cleanly on SIGTERM.
mod common;

use serde_json::json;
use std::time::Duration;

use common::{AgentProc, free_port, get_text, start_two_agents};
use kvloop_agent::client::{AgentClient, ClientError};
use kvloop_agent::lease::ReleaseReason;
use kvloop_agent::proto::{EngineEvent, ReadDirection};
use kvloop_cli::pattern;
use kvloop_dataplane::{BlockPair, HostRegion, KvLayout};

const BLOCK: u64 = 8192;

fn layout() -> KvLayout {
    common::kv_layout(2, 16, BLOCK)
}

fn regions(tag: u64) -> Vec<HostRegion> {
    common::patterned_regions("test", &layout(), tag)
}

fn block_holds(regs: &[HostRegion], local: u64, tag: u64, remote: u64) -> bool {
    regs.iter().enumerate().all(|(r, reg)| {
        let mut buf = vec![0u8; BLOCK as usize];
        reg.read_at((local * BLOCK) as usize, &mut buf);
        pattern::matches(tag, r as u64, remote, &buf)
    })
}

fn config(
    dir: &std::path::Path,
    name: &str,
    http: u16,
    peer: &str,
    peer_http: u16,
) -> std::path::PathBuf {
    let tables = format!(
        r#"
[lease]
safety_margin_ms = 2000
[probe]
period_ms = 500
large_blocks = 4
# A router that is down (nothing listens on port 1): pushes fail and are
# retried in their own task; nothing else waits for them.
[[routers]]
url = "http://127.0.0.1:1"
token = "t"
[[pairs]]
prefill_engine_id = "p0"
decode_engine_id = "d0"
decode_peer = "{peer}"
bytes_per_token = 1024
"#
    );
    common::loopback_agent_toml(
        dir,
        name,
        (http, peer, peer_http),
        "push_period_ms = 300",
        &tables,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_both_ways_land_byte_exact_through_two_agents() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, mut b) = start_two_agents(dir.path(), config);

    // The socket is owner-only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&a.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let p_mem = regions(1);
    let d_mem = regions(2);
    let pa = AgentClient::connect(&a.socket, "test-p0").await.unwrap();
    let db = AgentClient::connect(&b.socket, "test-d0").await.unwrap();
    let d_events = AgentClient::connect(&b.socket, "test-d0-events")
        .await
        .unwrap();
    assert_eq!(pa.agent_id(), "node-a");
    let _p_sc = pa
        .register_memfd("p0", layout(), &p_mem, None)
        .await
        .unwrap();
    let d_sc = db
        .register_memfd("d0", layout(), &d_mem, None)
        .await
        .unwrap();
    assert_eq!(pa.connect_remote("p0", d_sc).await.unwrap(), "d0");

    // Bad input names the field and the agent keeps serving.
    let e = db.retain("d0", "r", vec![99], None).await.unwrap_err();
    assert!(e.to_string().contains("block_ids[0]"), "{e}");
    let e = pa
        .register_memfd("p1", layout(), &p_mem[..1], None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("layout.num_regions"), "{e}");

    // D retains blocks 3 and 4 of its request under a TTL.
    db.retain("d0", "req-d", vec![3, 4], Some(60_000))
        .await
        .unwrap();
    // P's agent learns where d0 lives from B's /v1/engines (discovery, 1 s period).
    let mut renewed = None;
    for _ in 0..100 {
        match pa.renew("d0", "req-d", 10_000).await {
            Ok(l) => {
                renewed = Some(l);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let l = renewed.expect("A renews d0's lease through B within 10 s");
    assert_eq!(l.block_ids, vec![3, 4]);

    // D→P: P reads D's blocks 3,4 into its blocks 0,1, lease checked, owner notified.
    let done = pa
        .read(
            "p0",
            "d0",
            vec![
                BlockPair {
                    remote: 3,
                    local: 0,
                },
                BlockPair {
                    remote: 4,
                    local: 1,
                },
            ],
            ReadDirection::D2p,
            Some(("req-d", 1)),
            true,
            Some(10_000),
        )
        .await
        .unwrap();
    assert_eq!(done.bytes, 2 * 2 * BLOCK);
    assert_eq!(done.descriptors, 4);
    assert!(
        block_holds(&p_mem, 0, 2, 3),
        "block 0 of p0 holds d0's block 3"
    );
    assert!(
        block_holds(&p_mem, 1, 2, 4),
        "block 1 of p0 holds d0's block 4"
    );
    assert!(
        block_holds(&p_mem, 2, 1, 2),
        "untouched blocks keep their contents"
    );

    // D gets the notification and the release of its blocks.
    let mut got_notif = false;
    let mut released = None;
    for _ in 0..50 {
        for ev in d_events.events("d0", 200).await.unwrap() {
            match ev {
                EngineEvent::Notification {
                    owner_request_id,
                    count,
                    from_engine_id,
                } => {
                    assert_eq!(
                        (owner_request_id.as_str(), count, from_engine_id.as_str()),
                        ("req-d", 1, "p0")
                    );
                    got_notif = true;
                }
                EngineEvent::Released(r) => released = Some(r),
            }
        }
        if got_notif && released.is_some() {
            break;
        }
    }
    assert!(got_notif, "owner notification reached d0");
    let r = released.expect("d0's blocks released after the notification");
    assert_eq!(
        (r.reason, r.block_ids),
        (ReleaseReason::Notified, vec![3, 4])
    );

    // P→D: D reads P's fresh blocks 5,6 into its blocks 10,11.
    let done = db
        .read(
            "d0",
            "p0",
            vec![
                BlockPair {
                    remote: 5,
                    local: 10,
                },
                BlockPair {
                    remote: 6,
                    local: 11,
                },
            ],
            ReadDirection::P2d,
            None,
            false,
            Some(10_000),
        )
        .await
        .unwrap();
    assert_eq!(done.bytes, 2 * 2 * BLOCK);
    assert!(block_holds(&d_mem, 10, 1, 5));
    assert!(block_holds(&d_mem, 11, 1, 6));

    // A lease that expires within the safety margin (2 s): the READ is declined.
    db.retain("d0", "req-short", vec![7], Some(1_500))
        .await
        .unwrap();
    let before = {
        let mut b = vec![0u8; BLOCK as usize];
        p_mem[0].read_at((8 * BLOCK) as usize, &mut b);
        b
    };
    let e = pa
        .read(
            "p0",
            "d0",
            vec![BlockPair {
                remote: 7,
                local: 8,
            }],
            ReadDirection::D2p,
            Some(("req-short", 1)),
            true,
            None,
        )
        .await
        .unwrap_err();
    match &e {
        ClientError::Api(a) => assert_eq!(a.kind.as_str(), "lease", "{e}"),
        other => panic!("{other}"),
    }
    let mut after = vec![0u8; BLOCK as usize];
    p_mem[0].read_at((8 * BLOCK) as usize, &mut after);
    assert_eq!(
        before, after,
        "a declined READ does not touch the destination"
    );
    // ... and it expires, telling the owner.
    let mut expired = false;
    for _ in 0..30 {
        if d_events.events("d0", 200).await.unwrap().iter().any(|e| {
            matches!(e, EngineEvent::Released(r) if r.request_id == "req-short" && r.reason == ReleaseReason::Expired)
        }) {
            expired = true;
            break;
        }
    }
    assert!(expired, "the short lease expired and d0 was told");

    // The router releases a hold (issue 15) through agent A, which does not
    // host d0 and forwards the decision to B: a READ of it after that is
    // declined, the destination untouched, and d0 is told (reason router).
    db.retain("d0", "req-rel", vec![9], Some(60_000))
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let url = format!("http://{}/v1/leases/retention", a.http);
    let release = json!({"version": 1, "engine_id": "d0", "request_id": "req-rel", "keep_ms": 0});
    // Unauthenticated: refused (agent A pushes to a router with token "t").
    let anon = http.post(&url).json(&release).send().await.unwrap();
    assert_eq!(anon.status(), 401);
    let post = |body: serde_json::Value| http.post(&url).bearer_auth("t").json(&body).send();
    let r: serde_json::Value = post(release.clone()).await.unwrap().json().await.unwrap();
    assert_eq!(r, json!({"outcome": "released", "blocks": 1}), "{r}");
    let again: serde_json::Value = post(release).await.unwrap().json().await.unwrap();
    assert_eq!(
        again,
        json!({"outcome": "unknown"}),
        "at least once: a repeat is a no-op"
    );
    let e = pa
        .read(
            "p0",
            "d0",
            vec![BlockPair {
                remote: 9,
                local: 8,
            }],
            ReadDirection::D2p,
            Some(("req-rel", 1)),
            true,
            None,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, ClientError::Api(a) if a.kind.as_str() == "lease"),
        "{e}"
    );
    let mut after_release = vec![0u8; BLOCK as usize];
    p_mem[0].read_at((8 * BLOCK) as usize, &mut after_release);
    assert_eq!(before, after_release, "a released hold is never read");
    let mut told = false;
    for _ in 0..30 {
        if d_events.events("d0", 200).await.unwrap().iter().any(|e| {
            matches!(e, EngineEvent::Released(r) if r.request_id == "req-rel" && r.reason == ReleaseReason::Router)
        }) {
            told = true;
            break;
        }
    }
    assert!(told, "d0 was told its hold was released by the router");
    // Bad input names the field; an engine nobody hosts is a 404.
    let bad = post(json!({"version": 1, "engine_id": "d0"}))
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert!(bad.text().await.unwrap().contains("request_id"));
    let nobody = post(json!({"version": 1, "engine_id": "d9", "request_id": "x", "keep_ms": 0}))
        .await
        .unwrap();
    assert_eq!(nobody.status(), 404);

    // Metrics and health over HTTP.
    let m = get_text(&a.http, "/metrics").await;
    assert!(
        m.contains("kvloop_agent_reads_total{direction=\"d2p\",result=\"ok\"} 1"),
        "{m}"
    );
    assert!(m.contains("kvloop_agent_engines 1"), "{m}");
    assert!(
        m.contains("kvloop_agent_pushes_total{router=\"http://127.0.0.1:1\",result=\"error\"}"),
        "pushes to the router that is down were attempted and failed: {m}"
    );
    assert!(
        m.contains(
            "kvloop_agent_pull_notices_total{router=\"http://127.0.0.1:1\",notice=\"abandoned\",result=\"error\"}"
        ),
        "the declined READ's notice was sent to the router (down): {m}"
    );
    assert!(
        m.contains(
            "kvloop_agent_pull_notices_total{router=\"http://127.0.0.1:1\",notice=\"read\",result=\"error\"}"
        ),
        "the completed D→P READ's notice was sent to the router (down): {m}"
    );
    let h = reqwest::get(format!("http://{}/healthz", a.http))
        .await
        .unwrap();
    assert!(h.status().is_success());

    // Closing the registering connection unregisters the engine.
    drop(pa);
    let mut gone = false;
    for _ in 0..50 {
        let m = get_text(&a.http, "/metrics").await;
        if m.contains("kvloop_agent_engines 0") {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "p0 unregistered when its engine's connection closed");

    drop((db, d_events));
    assert!(a.stop(), "agent A exits cleanly on SIGTERM");
    assert!(b.stop(), "agent B exits cleanly on SIGTERM");
    assert!(
        !dir.path().join("node-a.sock").exists(),
        "socket removed at shutdown"
    );
}

/// A client of another uid is refused by the `SO_PEERCRED` check even when
/// the socket's file mode would let it connect (root needed to switch uid).
#[test]
#[ignore = "needs root (switching uid)"]
fn another_uid_is_refused() {
    common::require_root("another_uid_is_refused");
    let dir = tempfile::tempdir().unwrap();
    let (h, ph) = (free_port("127.0.0.1"), free_port("127.0.0.1"));
    let cfg = config(dir.path(), "node-u", h, "node-v", ph);
    let sock = dir.path().join("node-u.sock");
    let mut a = AgentProc::start(&[], &cfg, &sock);
    use std::os::unix::fs::PermissionsExt;
    // Open the file mode and the directory so that only SO_PEERCRED stands in the way.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let script = r#"
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
body = json.dumps({"op": "status"}).encode()
try:
    s.sendall(struct.pack("<I", len(body)) + body)
except OSError:
    pass
head = s.recv(4)
n = struct.unpack("<I", head)[0]
data = b""
while len(data) < n:
    data += s.recv(n - len(data))
print(data.decode())
"#;
    use std::os::unix::process::CommandExt;
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&sock)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3 (the test's foreign-uid client)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("forbidden") && text.contains("65534"),
        "stdout: {text} stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(a.stop());
}
