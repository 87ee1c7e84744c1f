//! Observe mode's attribution (pure): which peer agent, and which
//! direction, a kernel-timed transfer is for, or why it is not recorded.
//!
//! Two kinds of transfer reach the agent's eBPF drain:
//! * the agent's own READs (managed mode), seen at kvloop's dataplane sites
//!   (`site = "kvloop"`) in the agent's process; their peer is the owner
//!   engine's id, which a peer agent's `GET /v1/engines` lists;
//! * stock engines' READs and WRITEs, seen by the NIXL library probes on
//!   their `libnixl.so` (`site = "nixl"`, `observe.nixl_libs`) in other
//!   processes; their peer is the NIXL remote agent name, which vLLM draws
//!   at random at every start, so it is matched against engine ids first
//!   and otherwise given to the only peer this agent has (a 1P1D node
//!   pair), never guessed among several.
//!
//! A NIXL `READ` brings the peer's blocks here (inbound); a `WRITE` sends
//! this node's blocks to the peer (outbound).
use kvloop_common::{Direction, XferOp};
use kvloop_costmodel::Direction as CmDirection;
use kvloop_probes::XferSample;

/// Why a transfer sample is not recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Failed, empty, or without a latency.
    Incomplete,
    /// An active probe READ (recorded by the probe task itself).
    Probe,
    /// A process outside the agent's scope (`observe.scope`), or an engine's
    /// transfer at a site other than its NIXL library.
    OutOfScope,
    /// The agent's own transfer seen in a NIXL library (counted at kvloop's
    /// own sites already).
    Duplicate,
    /// No peer agent matches the transfer's peer, and the agent has not
    /// exactly one peer.
    Unattributed,
    /// A NIXL transfer whose operation could not be read.
    UnknownOp,
}

impl Skip {
    /// Metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Incomplete => "incomplete",
            Skip::Probe => "probe",
            Skip::OutOfScope => "out_of_scope",
            Skip::Duplicate => "duplicate",
            Skip::Unattributed => "unattributed",
            Skip::UnknownOp => "unknown_op",
        }
    }
}

/// What the drain knows when it attributes one sample.
pub struct Context<'a> {
    /// The agent's process id.
    pub own_pid: u32,
    /// Whether process `tgid` is in the agent's scope (`observe.scope`).
    pub in_scope: &'a dyn Fn(u32) -> bool,
    /// The peer agent hosting an engine id (or the longer ids a
    /// [`kvloop_common::PEER_LEN`]-byte truncated id is a prefix of).
    pub peer_of: &'a dyn Fn(&str) -> Option<String>,
    /// The agent's only peer, when it has exactly one.
    pub sole_peer: Option<&'a str>,
}

/// The peer agent and direction of a sample, or why it is not recorded.
///
/// # Errors
/// The [`Skip`] reason.
pub fn attribute(x: &XferSample, cx: &Context<'_>) -> Result<(String, CmDirection), Skip> {
    if x.status != 0 || x.bytes == 0 || x.descriptors == 0 || x.latency_ns == 0 {
        return Err(Skip::Incomplete);
    }
    if x.direction == Direction::Probe {
        return Err(Skip::Probe);
    }
    if x.tgid == cx.own_pid {
        if x.site != "kvloop" {
            return Err(Skip::Duplicate);
        }
        let peer = (cx.peer_of)(&x.peer).ok_or(Skip::Unattributed)?;
        return Ok((peer, CmDirection::Inbound));
    }
    if x.site != "nixl" || !(cx.in_scope)(x.tgid) {
        return Err(Skip::OutOfScope);
    }
    let dir = match x.op {
        XferOp::Read => CmDirection::Inbound,
        XferOp::Write => CmDirection::Outbound,
        XferOp::Unknown => return Err(Skip::UnknownOp),
    };
    let peer = (cx.peer_of)(&x.peer)
        .or_else(|| cx.sole_peer.map(str::to_string))
        .ok_or(Skip::Unattributed)?;
    Ok((peer, dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvloop_probes::Source;

    fn sample(tgid: u32, site: &'static str, op: XferOp, peer: &str) -> XferSample {
        XferSample {
            source: Source::Ebpf,
            site,
            tgid,
            id: 1,
            start_ns: 1,
            latency_ns: 2_000_000,
            bytes: 1 << 20,
            descriptors: 4,
            direction: Direction::Unknown,
            op,
            peer: peer.into(),
            status: 0,
        }
    }

    fn known(id: &str) -> Option<String> {
        (id == "d0").then(|| "node-d".to_string())
    }

    /// The agent is pid 7; `d0` is hosted by `node-d`.
    fn context<'a>(in_scope: &'a dyn Fn(u32) -> bool, sole_peer: Option<&'a str>) -> Context<'a> {
        Context {
            own_pid: 7,
            in_scope,
            peer_of: &known,
            sole_peer,
        }
    }

    #[test]
    fn own_reads_are_inbound_from_the_owner_engines_agent() {
        let scope = |_: u32| true;
        let cx = context(&scope, None);
        let x = sample(7, "kvloop", XferOp::Unknown, "d0");
        assert_eq!(
            attribute(&x, &cx),
            Ok(("node-d".into(), CmDirection::Inbound))
        );
        // The agent's own READ also passing through a libnixl it uses.
        assert_eq!(
            attribute(&sample(7, "nixl", XferOp::Read, "d0"), &cx),
            Err(Skip::Duplicate)
        );
        assert_eq!(
            attribute(&sample(7, "kvloop", XferOp::Unknown, "x"), &cx),
            Err(Skip::Unattributed)
        );
    }

    #[test]
    fn engine_reads_and_writes_by_op_and_sole_peer() {
        let scope = |pid: u32| pid != 99;
        let cx = context(&scope, Some("node-d"));
        // vLLM's NIXL agent names are random UUIDs: the sole peer.
        let r = sample(
            40,
            "nixl",
            XferOp::Read,
            "5b3c9e1a-0d4f-4e55-9a0e-3f2b1c7d8e90",
        );
        assert_eq!(
            attribute(&r, &cx),
            Ok(("node-d".into(), CmDirection::Inbound))
        );
        let w = sample(40, "nixl", XferOp::Write, "d0");
        assert_eq!(
            attribute(&w, &cx),
            Ok(("node-d".into(), CmDirection::Outbound))
        );
        assert_eq!(
            attribute(&sample(99, "nixl", XferOp::Read, "d0"), &cx),
            Err(Skip::OutOfScope)
        );
        assert_eq!(
            attribute(&sample(40, "kvloop", XferOp::Read, "d0"), &cx),
            Err(Skip::OutOfScope)
        );
        assert_eq!(
            attribute(&sample(40, "nixl", XferOp::Unknown, "d0"), &cx),
            Err(Skip::UnknownOp)
        );
    }

    #[test]
    fn several_peers_are_never_guessed_between() {
        let scope = |_: u32| true;
        let cx = context(&scope, None);
        let r = sample(40, "nixl", XferOp::Read, "uuid-of-someone");
        assert_eq!(attribute(&r, &cx), Err(Skip::Unattributed));
        let mut failed = sample(40, "nixl", XferOp::Read, "d0");
        failed.status = -5;
        assert_eq!(attribute(&failed, &cx), Err(Skip::Incomplete));
        let mut probe = sample(7, "kvloop", XferOp::Unknown, "d0");
        probe.direction = Direction::Probe;
        assert_eq!(attribute(&probe, &cx), Err(Skip::Probe));
    }
}
