//! `kvloop explain --pair P,D`: asks a kvloop agent (`GET /v1/explain` on
//! its HTTP address) why pair (P, D) has its recompute threshold: the
//! threshold, the fitted transfer and prefill models, the samples behind
//! them and the history of changes with their reasons.
//!
//! `kvloop explain --router HOST:PORT [--request-id ID] [--last N]`: asks a
//! router (`GET /admin/routes`, with its admin token) why its last turns
//! went where they went: policy, reason, P, D, pull or recompute, and the
//! predicted times of the chosen and the runner-up option.
//!
//! `kvloop explain --router HOST:PORT --retention [--last N]`: asks the
//! router (`GET /admin/retention`) what it decided about decode engines'
//! holds (issue 15): mode and bounds, the agent of each D, each tenant's
//! inter-turn gaps, and its last decisions (release / keep, why, the
//! expected TTFT saved against the blocks' cost, the agent's answer).
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Arguments of `kvloop explain`.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The pair: `<prefill engine id>,<decode engine id>` (asks the agent).
    #[arg(long, required_unless_present = "router")]
    pub pair: Option<String>,
    /// A router's address (`host:port`): explain its last routed turns instead.
    #[arg(long, conflicts_with = "pair")]
    pub router: Option<String>,
    /// With `--router`: its admin token.
    #[arg(
        long,
        env = "KVLOOP_ROUTER_ADMIN_TOKEN",
        hide_env_values = true,
        default_value = ""
    )]
    pub token: String,
    /// With `--router`: its decode-side retention decisions instead of routes.
    #[arg(long, requires = "router")]
    pub retention: bool,
    /// With `--router`: only this request id.
    #[arg(long)]
    pub request_id: Option<String>,
    /// With `--router`: how many of the last turns.
    #[arg(long, default_value_t = 20)]
    pub last: usize,
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
    get_auth(addr, path, None)
}

/// [`get`] with a bearer token.
fn get_auth(addr: &str, path: &str, token: Option<&str>) -> Result<(u16, String)> {
    let host = addr.trim_start_matches("http://").trim_end_matches('/');
    let sa = host
        .to_socket_addrs()
        .with_context(|| format!("--agent `{addr}`: expected host:port"))?
        .next()
        .with_context(|| format!("--agent `{addr}`: no address"))?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(3))
        .with_context(|| format!("connecting to the agent at {sa}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n"
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
    if let Some(r) = &a.router {
        return if a.retention {
            retention(&a, r)
        } else {
            routes(&a, r)
        };
    }
    let pair = a.pair.clone().unwrap_or_default();
    if pair.split(',').filter(|s| !s.trim().is_empty()).count() != 2 {
        bail!("--pair `{pair}`: expected `<prefill engine id>,<decode engine id>`");
    }
    let (status, body) = get(&a.agent, &format!("/v1/explain?pair={}", encode(&pair)))?;
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

/// One line per routed turn (`--router`).
fn route_line(r: &serde_json::Value) -> String {
    let s = |k: &str| r[k].as_str().unwrap_or("-").to_string();
    let mut line = format!(
        "{} {}: {} → prefill {} decode {} {} (reused {} of {} reusable, previous decode {}; decision {})",
        s("request_id"),
        s("policy"),
        s("reason"),
        s("prefill_engine_id"),
        s("decode_engine_id"),
        s("action"),
        r["reused_tokens"],
        r["reusable_tokens"],
        s("previous_decode_engine_id"),
        s("decision")
    );
    for (label, o) in [("chosen", &r["chosen"]), ("runner-up", &r["runner_up"])] {
        if o.is_object() {
            line.push_str(&format!(
                "\n    {label}: {} {} predicted TTFT {:.1} ms = queue {:.1} + reuse {:.1} + suffix {:.1}",
                o["prefill_engine_id"].as_str().unwrap_or("-"),
                o["action"].as_str().unwrap_or("-"),
                o["ttft_ms"].as_f64().unwrap_or(f64::NAN),
                o["queue_ms"].as_f64().unwrap_or(f64::NAN),
                o["reuse_ms"].as_f64().unwrap_or(f64::NAN),
                o["suffix_ms"].as_f64().unwrap_or(f64::NAN)
            ));
            if let Some(a) = o["abandon_after_ms"].as_f64() {
                line.push_str(&format!(
                    " (P's agent abandons the READ after {a:.0} ms and P recomputes)"
                ));
            }
        }
    }
    line
}

/// GET `path` of the router with the admin token, as JSON.
fn router_json(a: &ExplainArgs, router: &str, path: &str) -> Result<serde_json::Value> {
    let (status, body) = get_auth(router, path, Some(&a.token))?;
    if status == 401 {
        bail!(
            "router refused the token (401): pass --token or KVLOOP_ROUTER_ADMIN_TOKEN (its admin_token)"
        );
    }
    let v: serde_json::Value = serde_json::from_str(&body)
        .with_context(|| format!("router answered HTTP {status} with a non-JSON body: {body}"))?;
    if status != 200 {
        bail!("router: HTTP {status}: {body}");
    }
    Ok(v)
}

fn routes(a: &ExplainArgs, router: &str) -> Result<()> {
    let mut path = format!("/admin/routes?n={}", a.last);
    if let Some(id) = &a.request_id {
        path.push_str(&format!("&request_id={}", encode(id)));
    }
    let v = router_json(a, router, &path)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let list = v["routes"].as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        println!(
            "no routed turns{}",
            a.request_id
                .as_ref()
                .map_or(String::new(), |id| format!(" for request {id}"))
        );
    }
    for r in &list {
        println!("{}", route_line(r));
    }
    Ok(())
}

fn retention(a: &ExplainArgs, router: &str) -> Result<()> {
    let v = router_json(a, router, &format!("/admin/retention?n={}", a.last))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", retention_text(&v));
    }
    Ok(())
}

/// The text of `--retention`: bounds, agents, tenants' gaps, one line per
/// decision (newest last).
fn retention_text(v: &serde_json::Value) -> String {
    let c = &v["config"];
    let f = |x: &serde_json::Value| x.as_f64().map_or("-".into(), |x| format!("{x}"));
    let secs = |x: &serde_json::Value| {
        x.as_f64().map_or("-".into(), |x| {
            if x < 10_000.0 {
                format!("{x:.0} ms")
            } else {
                format!("{:.1} s", x / 1e3)
            }
        })
    };
    let mut o = format!(
        "retention {}: max hold {} ms, min lease {} ms; first lease = p{} of the tenant's gaps or the conversation's last gap × {}, once a tenant has {} gaps (the max hold until then); cost {} ms per block-second at half-full KV\n",
        c["mode"].as_str().unwrap_or("-"),
        f(&c["max_hold_ms"]),
        f(&c["min_lease_ms"]),
        c["gap_quantile"]
            .as_f64()
            .map_or("-".into(), |q| format!("{}", q * 100.0)),
        f(&c["conversation_gap_factor"]),
        f(&c["min_gap_samples"]),
        f(&c["block_second_cost_ms"]),
    );
    match v["agents"].as_object() {
        Some(m) if !m.is_empty() => {
            for (d, url) in m {
                o.push_str(&format!(
                    "decisions about {d} go to {} (the agent that pushes its pair; it forwards them to the agent hosting {d})\n",
                    url.as_str().unwrap_or("-")
                ));
            }
        }
        _ => o.push_str("no agent known (no push with agent_url): decisions are only counted\n"),
    }
    for t in v["tenants"].as_array().into_iter().flatten() {
        o.push_str(&format!(
            "tenant {}: {} gaps, p50 {}, p90 {}\n",
            t["tenant"].as_str().unwrap_or("-"),
            f(&t["samples"]),
            secs(&t["gap_p50_ms"]),
            secs(&t["gap_p90_ms"]),
        ));
    }
    for (d, u) in v["kv_usage"].as_object().into_iter().flatten() {
        o.push_str(&format!(
            "KV usage of {d}: {:.0} %\n",
            u.as_f64().unwrap_or(f64::NAN) * 100.0
        ));
    }
    o.push_str(&format!("holds followed: {}\n", f(&v["followed"])));
    let shown = v["decisions"].as_array().map_or(0, Vec::len);
    o.push_str(&format!(
        "last {shown} of {} decisions kept (--last N for more), oldest first:\n",
        f(&v["decisions_kept"])
    ));
    for d in v["decisions"].as_array().into_iter().flatten() {
        let s = |k: &str| d[k].as_str().unwrap_or("-").to_string();
        let what = if d["keep_ms"].as_u64() == Some(0) {
            "release".to_string()
        } else {
            format!("keep {} ms", f(&d["keep_ms"]))
        };
        let mut why = format!("{} ({})", s("cause"), s("reason"));
        if d["value_ms"].as_f64().unwrap_or(0.0) > 0.0 || d["cost_ms"].as_f64().unwrap_or(0.0) > 0.0
        {
            why.push_str(&format!(
                ", expected TTFT saved {:.3} ms against a cost of {:.3} ms",
                d["value_ms"].as_f64().unwrap_or(0.0),
                d["cost_ms"].as_f64().unwrap_or(0.0)
            ));
        }
        o.push_str(&format!(
            "  at {} ms: {what}: D {} request {} ({}): {why} → {}\n",
            f(&d["at_ms"]),
            s("decode_engine_id"),
            s("request_id"),
            s("conversation"),
            s("result"),
        ));
    }
    o
}

#[cfg(test)]
mod tests {
    #[test]
    fn retention_decisions_read_one_per_line() {
        let v = serde_json::json!({"config": {"mode": "adaptive", "max_hold_ms": 480000, "min_lease_ms": 5000,
                "gap_quantile": 0.9, "conversation_gap_factor": 2.0, "min_gap_samples": 20, "block_second_cost_ms": 0.0005},
            "agents": {"d0": "http://10.0.0.1:9470"},
            "tenants": [{"tenant": "default", "samples": 42, "gap_p50_ms": 2100.0, "gap_p90_ms": 18300.0}],
            "followed": 3, "kv_usage": {"d0": 0.42}, "decisions_kept": 7,
            "decisions": [
                {"at_ms": 1000, "action": "keep", "keep_ms": 16600, "cause": "first_lease", "reason": "tenant_gaps",
                 "conversation": "default/c1", "decode_engine_id": "d0", "request_id": "r1", "value_ms": 0.0, "cost_ms": 0.0, "result": "kept"},
                {"at_ms": 17600, "action": "release", "keep_ms": 0, "cause": "not_renewed", "reason": "not_worth",
                 "conversation": "default/c1", "decode_engine_id": "d0", "request_id": "r1", "value_ms": 0.4, "cost_ms": 1.25, "result": "released"}]});
        let t = super::retention_text(&v);
        assert!(
            t.starts_with("retention adaptive: max hold 480000 ms"),
            "{t}"
        );
        assert!(
            t.contains(
                "decisions about d0 go to http://10.0.0.1:9470 (the agent that pushes its pair"
            ),
            "{t}"
        );
        assert!(t.contains("last 2 of 7 decisions kept"), "{t}");
        assert!(t.contains("KV usage of d0: 42 %"), "{t}");
        assert!(
            t.contains("tenant default: 42 gaps, p50 2100 ms, p90 18.3 s"),
            "{t}"
        );
        assert!(
            t.contains(
                "  at 1000 ms: keep 16600 ms: D d0 request r1 (default/c1): first_lease (tenant_gaps) → kept"
            ),
            "{t}"
        );
        assert!(t.contains("release: D d0 request r1 (default/c1): not_renewed (not_worth), expected TTFT saved 0.400 ms against a cost of 1.250 ms → released"), "{t}");
    }

    #[test]
    fn a_route_reads_as_one_line_and_its_options() {
        let r = serde_json::json!({"request_id": "r1", "policy": "predicted_ttft", "reason": "predicted_pull",
            "decision": "pulled", "prefill_engine_id": "p0", "decode_engine_id": "d1", "action": "pull",
            "reused_tokens": 4096, "reusable_tokens": 4096, "previous_decode_engine_id": "d2",
            "chosen": {"prefill_engine_id": "p0", "action": "pull", "ttft_ms": 12.0, "queue_ms": 1.0, "reuse_ms": 2.0, "suffix_ms": 9.0},
            "runner_up": null});
        let l = super::route_line(&r);
        assert!(l.starts_with("r1 predicted_ttft: predicted_pull → prefill p0 decode d1 pull (reused 4096 of 4096 reusable, previous decode d2; decision pulled)"), "{l}");
        assert!(
            l.contains(
                "chosen: p0 pull predicted TTFT 12.0 ms = queue 1.0 + reuse 2.0 + suffix 9.0"
            ),
            "{l}"
        );
        assert!(!l.contains("runner-up"), "{l}");
    }

    #[test]
    fn encodes_query_values() {
        assert_eq!(super::encode("p0,d 0/x"), "p0,d%200%2Fx");
    }
}
