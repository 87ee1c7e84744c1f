//! The network checks of `kvloop doctor` (side channels, routers, clocks):
//! pure functions of [`Facts`], like the rest of [`super`].
use super::{Check, Level, bad, ok, skip};
use crate::doctor::facts::Facts;

/// Side-channel addresses: not loopback (nor unspecified) while peers are
/// on other hosts.
pub fn side_channels(f: &Facts) -> Check {
    const N: &str = "side_channel";
    let scs = match &f.side_channels {
        Ok(s) if s.is_empty() => return skip(N, "no side channel (probes off, no engines)"),
        Ok(s) => s,
        Err(e) => {
            return bad(
                N,
                Level::Warn,
                format!("side channels unknown: {e}"),
                "give --agent URL (the agent's /v1/engines) or --config agent.toml",
            );
        }
    };
    let remote: Vec<&str> = f
        .peers
        .iter()
        .filter(|(_, a)| !a.ip().is_loopback())
        .map(|(n, _)| n.as_str())
        .collect();
    let list = scs
        .iter()
        .map(|(n, a)| format!("{n}={a}"))
        .collect::<Vec<_>>()
        .join(", ");
    let unspecified: Vec<_> = scs
        .iter()
        .filter(|(_, a)| a.ip().is_unspecified())
        .collect();
    if !unspecified.is_empty() {
        return bad(
            N,
            Level::Fail,
            format!("{list}: an unspecified address is advertised, peers cannot connect to it"),
            "set node_addr in agent.toml to this node's address on the KV network",
        );
    }
    let looped: Vec<_> = scs.iter().filter(|(_, a)| a.ip().is_loopback()).collect();
    if !looped.is_empty() && !remote.is_empty() {
        return bad(
            N,
            Level::Fail,
            format!(
                "{list}: loopback side channel while peers are on other hosts: {}",
                remote.join(",")
            ),
            "set node_addr in agent.toml to this node's address on the KV network (default 127.0.0.1)",
        );
    }
    ok(
        N,
        if remote.is_empty() {
            format!("{list} (every peer is local)")
        } else {
            format!("{list} routable from {}", remote.join(","))
        },
    )
}

/// Agent → router reachability and token.
pub fn routers(f: &Facts) -> Check {
    const N: &str = "routers";
    if f.routers.is_empty() {
        return bad(
            N,
            Level::Warn,
            "no router configured: thresholds are not pushed",
            "add [[routers]] url/token to agent.toml (--config)",
        );
    }
    let mut lines = Vec::new();
    let mut level = Level::Pass;
    let mut fixes = Vec::new();
    for r in &f.routers {
        let (l, txt, fix) = match (&r.health, &r.token) {
            (Err(e), _) => (
                Level::Fail,
                format!("{}: unreachable ({e})", r.url),
                "check the URL, the router Service and the nodes' security groups",
            ),
            (Ok(h), _) if *h != 200 => (
                Level::Warn,
                format!("{}: /health answered {h}", r.url),
                "the router answers but is not healthy: see its log",
            ),
            (Ok(_), Ok(401)) => (
                Level::Fail,
                format!(
                    "{}: token refused (401){}",
                    r.url,
                    if r.token_set {
                        ""
                    } else {
                        ", no token configured"
                    }
                ),
                "set [[routers]].token (or KVLOOP_AGENT_ROUTER_TOKEN) to the router's admin_token \
                 (Secret kvloop-router-admin)",
            ),
            (Ok(_), Ok(400)) => (
                Level::Pass,
                format!("{}: reachable, token accepted", r.url),
                "",
            ),
            (Ok(_), Ok(s)) => (
                Level::Warn,
                format!("{}: PUT /admin/thresholds answered {s}", r.url),
                "unexpected answer: is this a kvloop-router?",
            ),
            (Ok(_), Err(e)) => (
                Level::Fail,
                format!("{}: PUT /admin/thresholds failed ({e})", r.url),
                "check the router",
            ),
        };
        if l > Level::Pass && !fixes.contains(&fix) {
            fixes.push(fix);
        }
        level = level.max(l);
        lines.push(txt);
    }
    Check {
        name: N,
        level,
        detail: lines.join("; "),
        fix: (!fixes.is_empty()).then(|| fixes.join("; ")),
    }
}

/// Warn above this clock offset beyond the measurement's uncertainty, ms.
pub const CLOCK_WARN_MS: f64 = 1000.0;

/// Clock offsets to the peers.
pub fn clocks(f: &Facts) -> Check {
    const N: &str = "clock";
    if f.clocks.is_empty() {
        return skip(N, "no peers");
    }
    let mut lines = Vec::new();
    let mut level = Level::Pass;
    for c in &f.clocks {
        match &c.offset {
            Ok((off, unc)) => {
                if off.abs() - unc > CLOCK_WARN_MS {
                    level = level.max(Level::Warn);
                }
                lines.push(format!("{}: {off:+.0} ms ± {unc:.0}", c.peer));
            }
            Err(e) => {
                level = level.max(Level::Warn);
                lines.push(format!("{}: unreachable ({e})", c.peer));
            }
        }
    }
    let fix = (level > Level::Pass).then(|| {
        "run chrony/NTP on every node (EC2: the Amazon Time Sync Service, 169.254.169.123); \
         an unreachable peer: check its agent and port 9470"
            .to_string()
    });
    Check {
        name: N,
        level,
        detail: lines.join(", "),
        fix,
    }
}
