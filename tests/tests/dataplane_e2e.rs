//! Two `kvloop node` processes READ KV blocks from each other for real, on
//! libfabric `tcp;ofi_rxm` and `shm` and on NIXL-UCX, on loopback and across
//! two network namespaces joined by a veth; every block is verified
//! byte-exact against the owner's deterministic pattern.
use std::time::{Duration, Instant};

use kvloop_tests::*;
use serde_json::json;

const T: Duration = Duration::from_secs(30);

fn pairs_json(p: &[(u64, u64)]) -> serde_json::Value {
    json!(p.iter().map(|&(r, l)| json!([r, l])).collect::<Vec<_>>())
}

/// P (tag 1) and D (tag 2): P READs D's blocks (D→P) with an owner
/// notification, then D READs P's blocks (P→D) over the same handshake.
fn both_directions(p: &mut NodeChild, d: &mut NodeChild) {
    p.send(&json!({"cmd": "connect", "addr": d.side_channel()}))
        .unwrap();
    let c = p.wait_event("connected", T).unwrap();
    assert_eq!(c["peer"], "decode-0");
    let d2p = [(3, 10), (4, 11), (5, 12), (17, 0), (30, 31)];
    p.send(
        &json!({"cmd": "read", "peer": "decode-0", "pairs": pairs_json(&d2p), "direction": "d2p",
                   "notify": {"owner_request_id": "cmpl-7-0", "count": 1}, "verify_tag": 2}),
    )
    .unwrap();
    let r = p.wait_event("read", T).unwrap();
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["verified_blocks"], d2p.len() as u64, "{r}");
    assert_eq!(r["mismatched_blocks"], 0, "{r}");
    let n = d.wait_event("notification", T).unwrap();
    assert_eq!(n["owner_request_id"], "cmpl-7-0");
    assert_eq!(n["from"], "prefill-0");
    assert_eq!(n["count"], 1);
    let p2d = [(1, 5), (2, 6), (3, 7), (9, 30)]; // P blocks the D→P READ did not overwrite
    // D learned P from the same handshake; give its side a moment.
    let mut r = serde_json::Value::Null;
    for _ in 0..50 {
        d.send(&json!({"cmd": "read", "peer": "prefill-0", "pairs": pairs_json(&p2d), "direction": "p2d", "verify_tag": 1}))
            .unwrap();
        r = d.wait_event("read", T).unwrap();
        if r["ok"] == true
            || !r["error"]
                .as_str()
                .unwrap_or("")
                .contains("unknown remote engine")
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["verified_blocks"], p2d.len() as u64, "{r}");
    assert_eq!(r["mismatched_blocks"], 0, "{r}");
}

/// Placement and layout of a test pair of `kvloop node`s: decode-0 (filled
/// with tag 2) and prefill-0 (tag 1), on loopback or in a namespace pair
/// (D in `ns_b`, P in `ns_a`).
struct PairSpec<'a> {
    backend: &'a str,
    provider: &'a str,
    blocks: u32,
    p_block_bytes: u64,
    d_block_bytes: u64,
    netns: Option<&'a NodePair>,
}

impl<'a> PairSpec<'a> {
    fn loopback(backend: &'a str, provider: &'a str, blocks: u32, block_bytes: u64) -> Self {
        Self {
            backend,
            provider,
            blocks,
            p_block_bytes: block_bytes,
            d_block_bytes: block_bytes,
            netns: None,
        }
    }
}

/// Spawns decode-0 then prefill-0; returns (prefill, decode).
fn spawn_pair(s: &PairSpec) -> (NodeChild, NodeChild) {
    let node = |id: &str, tag: u64, block_bytes: u64, place: Option<(&str, std::net::Ipv4Addr)>| {
        let ip = place.map_or("127.0.0.1".to_string(), |(_, a)| a.to_string());
        let args = node_args(
            id,
            &format!("{ip}:0"),
            s.backend,
            s.provider,
            s.blocks,
            block_bytes,
            tag,
        );
        NodeChild::spawn(node_cmd(place.map(|(ns, _)| ns), &args)).unwrap()
    };
    let d = node(
        "decode-0",
        2,
        s.d_block_bytes,
        s.netns.map(|p| (p.ns_b.as_str(), p.addr_b)),
    );
    let p = node(
        "prefill-0",
        1,
        s.p_block_bytes,
        s.netns.map(|p| (p.ns_a.as_str(), p.addr_a)),
    );
    (p, d)
}

fn loopback(backend: &str, provider: &str) {
    let (mut p, mut d) = spawn_pair(&PairSpec::loopback(backend, provider, 32, 65536));
    both_directions(&mut p, &mut d);
}

#[test]
fn two_processes_tcp_rxm() {
    loopback("libfabric", "tcp;ofi_rxm");
}

#[test]
fn two_processes_shm() {
    loopback("libfabric", "shm");
}

#[test]
#[ignore = "needs the NIXL runtime (scripts/bootstrap.sh nixl)"]
fn two_processes_nixl_ucx() {
    nixl_libs("two_processes_nixl_ucx");
    loopback("nixl", "tcp;ofi_rxm");
}

fn across_namespaces(backend: &str, tag: u32) {
    require_root("across_namespaces");
    let pair = NodePair::create(tag).unwrap();
    let (mut p, mut d) = spawn_pair(&PairSpec {
        netns: Some(&pair),
        ..PairSpec::loopback(backend, "tcp;ofi_rxm", 32, 65536)
    });
    assert!(d.side_channel().starts_with(&pair.addr_b.to_string()));
    both_directions(&mut p, &mut d);
}

#[test]
#[ignore = "needs root (network namespaces)"]
fn two_namespaces_over_veth_tcp_rxm() {
    across_namespaces("libfabric", 9000 + std::process::id() % 500);
}

#[test]
#[ignore = "needs root (network namespaces) and the NIXL runtime (scripts/bootstrap.sh nixl)"]
fn two_namespaces_over_veth_nixl_ucx() {
    nixl_libs("two_namespaces_over_veth_nixl_ucx");
    across_namespaces("nixl", 9500 + std::process::id() % 400);
}

#[test]
#[ignore = "needs root (network namespaces)"]
fn peer_killed_mid_read_fails_within_timeout() {
    require_root("peer_killed_mid_read_fails_within_timeout");
    let pair = NodePair::create(8000 + std::process::id() % 900).unwrap();
    // 48 blocks × 2 regions × 1 MiB = 96 MiB through a 40 Mbit/s link: ~20 s.
    pair.limit_rate_b("40mbit").unwrap();
    let (mut p, mut d) = spawn_pair(&PairSpec {
        netns: Some(&pair),
        ..PairSpec::loopback("libfabric", "tcp;ofi_rxm", 48, 1 << 20)
    });
    p.send(&json!({"cmd": "connect", "addr": d.side_channel()}))
        .unwrap();
    p.wait_event("connected", T).unwrap();
    let all: Vec<(u64, u64)> = (0..48).map(|i| (i, i)).collect();
    let timeout_ms = 4000u64;
    let start = Instant::now();
    p.send(
        &json!({"cmd": "read", "peer": "decode-0", "pairs": pairs_json(&all), "direction": "d2p",
                   "timeout_ms": timeout_ms, "verify_tag": 2}),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    d.kill();
    let r = p
        .wait_event("read", Duration::from_millis(timeout_ms + 5000))
        .unwrap();
    let waited = start.elapsed();
    assert_eq!(r["ok"], false, "a READ from a killed peer must fail: {r}");
    assert!(
        waited < Duration::from_millis(timeout_ms + 3000),
        "error after {waited:?}, timeout was {timeout_ms} ms"
    );
    // The node keeps serving, and the destination blocks of the failed READ
    // are either quarantined or were released by an error completion.
    p.send(&json!({"cmd": "status"})).unwrap();
    let s = p.wait_event("status", T).unwrap();
    assert!(
        s["quarantined_blocks"].as_array().unwrap().len() <= 48,
        "{s}"
    );
}

#[test]
fn out_of_range_and_foreign_descriptors_are_refused_before_posting() {
    let (mut p, d) = spawn_pair(&PairSpec::loopback("libfabric", "tcp;ofi_rxm", 8, 4096));
    p.send(&json!({"cmd": "connect", "addr": d.side_channel()}))
        .unwrap();
    p.wait_event("connected", T).unwrap();
    // One good pair and one out of range: the whole READ is refused, and the
    // good pair's destination block still holds P's own data.
    p.send(&json!({"cmd": "read", "peer": "decode-0", "pairs": [[1, 2], [8, 3]], "verify_tag": 2}))
        .unwrap();
    let r = p.wait_event("read", T).unwrap();
    assert_eq!(r["ok"], false);
    let e = r["error"].as_str().unwrap();
    assert!(e.contains("blocks[1].remote") && e.contains("0..8"), "{e}");
    assert_eq!(r["source"], "local");
    p.send(&json!({"cmd": "check", "pairs": [[2, 2], [3, 3]], "tag": 1}))
        .unwrap();
    let c = p.wait_event("check", T).unwrap();
    assert_eq!(
        c["verified_blocks"], 2,
        "destination blocks were written: {c}"
    );
    // Local side out of range.
    p.send(&json!({"cmd": "read", "peer": "decode-0", "pairs": [[1, 9]]}))
        .unwrap();
    let e = p.wait_event("read", T).unwrap()["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(e.contains("blocks[0].local"), "{e}");
    // Foreign engine.
    p.send(&json!({"cmd": "read", "peer": "decode-9", "pairs": [[1, 2]]}))
        .unwrap();
    let e = p.wait_event("read", T).unwrap()["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(e.contains("unknown remote engine `decode-9`"), "{e}");
}

#[test]
fn mismatched_layouts_are_refused_at_handshake() {
    let (mut p, mut d) = spawn_pair(&PairSpec {
        d_block_bytes: 32768,
        ..PairSpec::loopback("libfabric", "tcp;ofi_rxm", 8, 65536)
    });
    p.send(&json!({"cmd": "connect", "addr": d.side_channel()}))
        .unwrap();
    let err = p.wait_event("connected", T).unwrap_err().to_string();
    assert!(err.contains("block_len_bytes"), "{err}");
    d.send(&json!({"cmd": "status"})).unwrap();
    let s = d.wait_event("status", T).unwrap();
    assert_eq!(s["peers"].as_array().unwrap().len(), 0, "{s}");
}

/// libfaketime's preload library (Debian package `faketime`).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// The owner runs under libfaketime (`FAKETIME=+1d`), whose user-space
/// `CLOCK_MONOTONIC` then reads the wall clock plus a day, far from the
/// kernel's: READs from it still succeed, each within a second.
#[test]
#[ignore = "needs libfaketime (Debian package faketime)"]
fn reads_do_not_depend_on_the_owners_monotonic_clock() {
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "needs libfaketime: {LIBFAKETIME} is missing (apt-get install faketime)"
    );
    let node = |id: &str, tag: u64| {
        node_cmd(
            None,
            &node_args(
                id,
                "127.0.0.1:0",
                "libfabric",
                "tcp;ofi_rxm",
                32,
                65536,
                tag,
            ),
        )
    };
    let mut owner = node("decode-0", 2);
    owner.env("LD_PRELOAD", LIBFAKETIME).env("FAKETIME", "+1d");
    let mut d = NodeChild::spawn(owner).unwrap();
    let mut p = NodeChild::spawn(node("prefill-0", 1)).unwrap();
    p.send(&json!({"cmd": "connect", "addr": d.side_channel()}))
        .unwrap();
    p.wait_event("connected", T).unwrap();
    let pairs: Vec<(u64, u64)> = (0..8).map(|i| (i, i)).collect();
    for i in 0..3 {
        let start = Instant::now();
        p.send(
            &json!({"cmd": "read", "peer": "decode-0", "pairs": pairs_json(&pairs),
                       "direction": "d2p", "timeout_ms": 5000, "verify_tag": 2}),
        )
        .unwrap();
        let r = p.wait_event("read", T).unwrap();
        let took = start.elapsed();
        assert_eq!(r["ok"], true, "READ {i} from a faketime'd owner: {r}");
        assert_eq!(r["verified_blocks"], 8, "{r}");
        assert!(took < Duration::from_secs(1), "READ {i} took {took:?}");
    }
    d.send(&json!({"cmd": "quit"})).unwrap();
}
