//! `kvloop node`: one transfer engine in a process, driven by JSON-line
//! commands on stdin and answering with JSON-line events on stdout. It is the
//! low-level tool to debug transfers by hand (or from a test or a script):
//! connect two nodes, READ chosen blocks either way, see notifications.
//!
//! Commands (one JSON object per line):
//! * `{"cmd":"connect","addr":"10.0.0.2:5555"}`
//! * `{"cmd":"read","peer":"decode-0","pairs":[[3,10],[4,11]],"direction":"d2p",
//!    "notify":{"owner_request_id":"r1","count":1},"timeout_ms":2000,"verify_tag":2}`
//! * `{"cmd":"notify","peer":"decode-0","owner_request_id":"r1","count":1}`
//! * `{"cmd":"check","pairs":[[3,10]],"tag":2}` (verify local blocks, no READ)
//! * `{"cmd":"status"}`, `{"cmd":"quit"}`
//!
//! Events: `ready`, `connected`, `read`, `notification`, `status`, `error`.
use kvloop_common::Direction;
use kvloop_dataplane::{BlockPair, OwnerNotify, ReadRequest, TransferEngine};
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

use kvloop_cli::engine_args::{EngineArgs, verify};

#[derive(Debug, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
enum Command {
    Connect {
        addr: std::net::SocketAddr,
    },
    Read {
        peer: String,
        pairs: Vec<(u64, u64)>,
        #[serde(default)]
        direction: Option<String>,
        #[serde(default)]
        notify: Option<OwnerNotify>,
        #[serde(default)]
        timeout_ms: Option<u64>,
        #[serde(default)]
        verify_tag: Option<u64>,
    },
    Notify {
        peer: String,
        owner_request_id: String,
        count: u32,
    },
    /// Verify local blocks against the pattern of (tag, region, source block)
    /// without reading: `pairs` are (source block, local block).
    Check {
        pairs: Vec<(u64, u64)>,
        tag: u64,
    },
    Status,
    Quit,
}

fn emit(v: serde_json::Value) {
    println!("{v}");
}

fn direction(s: Option<&str>) -> Result<Direction, String> {
    match s.unwrap_or("unknown") {
        "d2p" => Ok(Direction::DecodeToPrefill),
        "p2d" => Ok(Direction::PrefillToDecode),
        "probe" => Ok(Direction::Probe),
        "unknown" => Ok(Direction::Unknown),
        o => Err(format!(
            "field `direction`: `{o}`; expected d2p, p2d, probe or unknown"
        )),
    }
}

/// Runs the node until `quit` or end of stdin.
pub async fn run(args: EngineArgs) -> anyhow::Result<()> {
    let engine = args.start().await?;
    emit(json!({
        "event": "ready",
        "engine_id": engine.engine_id(),
        "side_channel": engine.side_channel_addr().to_string(),
        "backend": engine.backend_name(),
        "pid": std::process::id(),
    }));
    let mut notifs = engine.subscribe_notifications();
    tokio::spawn(async move {
        while let Ok(n) = notifs.recv().await {
            emit(json!({"event": "notification", "from": n.from_engine_id,
                        "owner_request_id": n.owner_request_id, "count": n.count}));
        }
    });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        if line.trim().is_empty() {
            continue;
        }
        let cmd: Command = match serde_json::from_str(&line) {
            Ok(c) => c,
            Err(e) => {
                emit(json!({"event": "error", "error": format!("bad command: {e}")}));
                continue;
            }
        };
        if matches!(cmd, Command::Quit) {
            break;
        }
        let engine = engine.clone();
        // Commands run concurrently, so a slow READ does not block `status`.
        tokio::spawn(async move { handle(&engine, cmd).await });
    }
    Ok(())
}

async fn handle(engine: &TransferEngine, cmd: Command) {
    match cmd {
        Command::Connect { addr } => match engine.connect(addr).await {
            Ok(md) => emit(
                json!({"event": "connected", "peer": md.engine_id, "addr": addr.to_string(),
                                  "backend": md.backend.describe()}),
            ),
            Err(e) => emit(json!({"event": "error", "cmd": "connect", "error": e.to_string()})),
        },
        Command::Read {
            peer,
            pairs,
            direction: dir,
            notify,
            timeout_ms,
            verify_tag,
        } => {
            let dir = match direction(dir.as_deref()) {
                Ok(d) => d,
                Err(e) => return emit(json!({"event": "error", "cmd": "read", "error": e})),
            };
            let blocks: Vec<BlockPair> = pairs
                .iter()
                .map(|&(remote, local)| BlockPair { remote, local })
                .collect();
            let req = ReadRequest {
                peer_engine_id: peer.clone(),
                blocks: blocks.clone(),
                direction: dir,
                notify,
                timeout_ms,
            };
            let start = std::time::Instant::now();
            match engine.read(&req).await {
                Ok(out) => {
                    let (verified, mismatched) = match verify_tag {
                        Some(tag) => verify(engine, tag, &blocks),
                        None => (0, 0),
                    };
                    emit(
                        json!({"event": "read", "ok": true, "peer": peer, "direction": dir.label(),
                                "xfer_id": out.xfer_id, "bytes": out.bytes, "descriptors": out.descriptors,
                                "elapsed_us": out.elapsed_us, "verified_blocks": verified,
                                "mismatched_blocks": mismatched}),
                    )
                }
                Err(e) => emit(
                    json!({"event": "read", "ok": false, "peer": peer, "error": e.to_string(),
                                      "source": e.source_kind().to_string(), "retry_safe": e.retry_safe(),
                                      "elapsed_ms": start.elapsed().as_millis() as u64}),
                ),
            }
        }
        Command::Notify {
            peer,
            owner_request_id,
            count,
        } => match engine.notify(&peer, &owner_request_id, count) {
            Ok(()) => emit(json!({"event": "notified", "peer": peer})),
            Err(e) => emit(json!({"event": "error", "cmd": "notify", "error": e.to_string()})),
        },
        Command::Check { pairs, tag } => {
            let blocks: Vec<BlockPair> = pairs
                .iter()
                .map(|&(remote, local)| BlockPair { remote, local })
                .collect();
            let l = engine.layout();
            if let Some(b) = blocks.iter().find(|b| b.local >= l.num_blocks as u64) {
                return emit(json!({"event": "error", "cmd": "check",
                                   "error": format!("field `pairs`: local block {} out of range 0..{}", b.local, l.num_blocks)}));
            }
            let (verified, mismatched) = verify(engine, tag, &blocks);
            emit(
                json!({"event": "check", "verified_blocks": verified, "mismatched_blocks": mismatched}),
            )
        }
        Command::Status => emit(
            json!({"event": "status", "engine_id": engine.engine_id(), "peers": engine.peers(),
                                       "quarantined_blocks": engine.quarantined_blocks()}),
        ),
        Command::Quit => {}
    }
}
