//! The pull notices an agent sends the routers ([`PullNotice`]): that a
//! pull's READ ended without the blocks ([`PULL_ABANDONED_PATH`]), or that
//! it ended with them ([`PULL_READ_PATH`]); and their parsing, which names
//! the bad field.
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Path of the abandoned-pull notice: `POST` with the same bearer token as
/// [`crate::THRESHOLDS_PATH`] and a JSON body [`PullNotice`]; `204 No
/// Content` whether or not the router knows the pull, `401` on a wrong
/// token, `400` naming the bad field ([`NoticeError`]).
pub const PULL_ABANDONED_PATH: &str = "/admin/pulls/abandoned";

/// Path of the read-pull notice: the READ of D's blocks completed, so P's
/// engine now queues the turn's suffix for compute. Same method, token,
/// body ([`PullNotice`], `cause` `"read"`) and answers as
/// [`PULL_ABANDONED_PATH`]. Sent by agents that say
/// `notices_read_pulls` in their pushed models
/// ([`crate::CostModelCoefficients::notices_read_pulls`]).
pub const PULL_READ_PATH: &str = "/admin/pulls/read";

/// Sent by P's agent to every router address at once when a managed READ
/// of D's blocks ends.
///
/// * Without the blocks (abandoned as slower than recomputing, failed, or
///   declined by D's lease), to [`PULL_ABANDONED_PATH`]: P now recomputes
///   the whole prompt. The router that sent the turn would otherwise learn
///   it only when P answers, and keep counting P busy for a READ's time
///   instead of a whole prompt's compute.
/// * With the blocks, to [`PULL_READ_PATH`]: P's engine schedules a
///   request once its remote KV arrived (vLLM's NIXL connector;
///   `kvloop-engine-sim` likewise), so the turn joins P's compute line
///   now. Until then the router does not count it ahead of turns P
///   computes while the READ runs.
///
/// A router that did not send the turn (another replica) ignores it.
/// Unknown fields are ignored (newer agents may send more).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PullNotice {
    /// Identity of the sending agent (its node name).
    pub agent_id: String,
    /// Engine id of the reader (P).
    pub prefill_engine_id: String,
    /// Engine id of the block owner (D): `remote_engine_id` of the
    /// `kv_transfer_params` the router attached.
    pub decode_engine_id: String,
    /// D's request id whose blocks were read: `remote_request_id` of those
    /// params (the READ's owner notification).
    pub decode_request_id: String,
    /// How long the READ ran before it ended, ms.
    pub after_ms: u64,
    /// How it ended: `"read"` (with the blocks), `"abandoned"` (slower
    /// than recomputing), `"failed"`, or `"declined"` (D's lease did not
    /// cover the blocks: nothing was read).
    pub cause: String,
}

/// A malformed notice: names the field and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("body{}: expected {expected}", if *.field == "." { String::new() } else { format!(".{}", .field) })]
pub struct NoticeError {
    /// The field (`"."` for the body itself).
    pub field: &'static str,
    /// What it must look like.
    pub expected: &'static str,
}

impl PullNotice {
    /// The cause of a READ that completed with the blocks.
    pub const READ: &'static str = "read";

    /// The path this notice goes to: [`PULL_READ_PATH`] for
    /// [`PullNotice::READ`], [`PULL_ABANDONED_PATH`] for every other cause.
    pub fn path(&self) -> &'static str {
        if self.cause == Self::READ {
            PULL_READ_PATH
        } else {
            PULL_ABANDONED_PATH
        }
    }

    /// Parses a notice body.
    ///
    /// # Errors
    /// [`NoticeError`] naming the first field that is missing or of the
    /// wrong type (`"."`: not a JSON object).
    pub fn parse(body: &[u8]) -> Result<Self, NoticeError> {
        let v: Value = serde_json::from_slice(body).map_err(|_| NoticeError {
            field: ".",
            expected: "a JSON object",
        })?;
        let o = v.as_object().ok_or(NoticeError {
            field: ".",
            expected: "a JSON object",
        })?;
        let text = |field: &'static str| {
            o.get(field)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .ok_or(NoticeError {
                    field,
                    expected: "a non-empty string",
                })
        };
        Ok(Self {
            agent_id: text("agent_id")?,
            prefill_engine_id: text("prefill_engine_id")?,
            decode_engine_id: text("decode_engine_id")?,
            decode_request_id: text("decode_request_id")?,
            after_ms: o
                .get("after_ms")
                .and_then(Value::as_u64)
                .ok_or(NoticeError {
                    field: "after_ms",
                    expected: "a whole number of milliseconds",
                })?,
            cause: text("cause")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice() -> PullNotice {
        PullNotice {
            agent_id: "node-a".into(),
            prefill_engine_id: "p0".into(),
            decode_engine_id: "d0".into(),
            decode_request_id: "cmpl-1".into(),
            after_ms: 127,
            cause: "abandoned".into(),
        }
    }

    #[test]
    fn parses_what_it_serializes_and_ignores_unknown_fields() {
        let mut v = serde_json::to_value(notice()).unwrap();
        v["later"] = serde_json::json!(1);
        let body = serde_json::to_vec(&v).unwrap();
        assert_eq!(PullNotice::parse(&body).unwrap(), notice());
    }

    #[test]
    fn bad_input_names_the_field() {
        let with = |field: &str, x: Value| {
            let mut v = serde_json::to_value(notice()).unwrap();
            v[field] = x;
            PullNotice::parse(&serde_json::to_vec(&v).unwrap())
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            with("after_ms", "soon".into()),
            "body.after_ms: expected a whole number of milliseconds"
        );
        assert_eq!(
            with("decode_request_id", "".into()),
            "body.decode_request_id: expected a non-empty string"
        );
        assert_eq!(
            PullNotice::parse(b"[1]").unwrap_err().to_string(),
            "body: expected a JSON object"
        );
        assert_eq!(PullNotice::parse(b"{").unwrap_err().field, ".", "not JSON");
    }
}
