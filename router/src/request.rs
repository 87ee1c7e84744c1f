//! Client request parsing and the prefill/decode body rewrites. Pure: no I/O.
use std::collections::HashMap;

use axum::http::HeaderMap;
use kvloop_router_api::json::{self, RawObject};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::fingerprint::History;
use crate::params::KvParams;

/// The two OpenAI endpoints the router serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

impl Api {
    /// The endpoint's path (same on the engines).
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
    /// Metric label value.
    pub fn label(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat_completions",
        }
    }
}

/// A client request the router can route.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// Endpoint.
    pub api: Api,
    /// The client's body, without `conversation_id` (and without a null
    /// `kv_transfer_params`).
    pub body: Map<String, Value>,
    /// The same members as `body`, each as the exact text the client sent,
    /// in the client's order (a repeated key once, at its first place, with
    /// its last value: what `body` holds). The bodies sent to the engines
    /// are written from these: copied, not re-serialized from `body`
    /// (re-serializing the messages for P, D and `/tokenize` was a fifth of
    /// the router's instructions per request in `chat_bench`).
    pub members: RawObject,
    /// `conversation_id` (body) or `x-session-id` (header).
    pub conversation_id: Option<String>,
    /// Tenant (the configured tenant header, else the default tenant).
    pub tenant: String,
    /// `stream: true`.
    pub stream: bool,
    /// `x-request-id`, when the client sent one.
    pub request_id: Option<String>,
    /// `model`, when a string.
    pub model: Option<String>,
    /// A token-id prompt (completions), when given.
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Why D's sequence may hold tokens the client never sees, from the
    /// request alone (a `store_skipped` reason): `include_reasoning: false`
    /// hides reasoning tokens D generated.
    pub hidden_output: Option<&'static str>,
    /// Stop strings were requested without `include_stop_str_in_output`:
    /// a stop on one of them leaves its tokens in D's blocks but not in the
    /// text.
    pub stop_str_hidden: bool,
}

impl ParsedRequest {
    /// The comparable history of the prompt.
    pub fn history(&self) -> History<'_> {
        match (self.api, self.body.get("prompt"), self.body.get("messages")) {
            (Api::Chat, _, Some(Value::Array(m))) => History::Chat(m),
            (Api::Completions, Some(Value::String(t)), _) => History::Text(t),
            _ => History::None,
        }
    }
}

/// A request the router refuses (HTTP 400), with a message naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

impl BadRequest {
    /// The field the message names (the text before its first `: `, e.g.
    /// `messages` or `kv_transfer_params`), for the error body's `param`;
    /// `None` for the body as a whole.
    pub fn param(&self) -> Option<&str> {
        let (field, _) = self.0.split_once(": ")?;
        (field != "body" && !field.is_empty() && !field.contains(char::is_whitespace))
            .then_some(field)
    }
}

fn bad(msg: impl Into<String>) -> BadRequest {
    BadRequest(msg.into())
}

/// The request's tenant: the `tenant_header` header, else `default_tenant`
/// (the rule of every client endpoint: completions and
/// `DELETE /v1/conversations/{id}`).
pub fn tenant_of(headers: &HeaderMap, tenant_header: &str, default_tenant: &str) -> String {
    headers
        .get(tenant_header)
        .and_then(|v| v.to_str().ok())
        .map_or_else(|| default_tenant.to_string(), str::to_string)
}

/// Parse a client request.
///
/// # Errors
/// [`BadRequest`]: not a JSON object, client-supplied `kv_transfer_params`,
/// missing `prompt`/`messages`, a non-string `conversation_id`.
pub fn parse_request(
    api: Api,
    headers: &HeaderMap,
    raw: &[u8],
    tenant_header: &str,
    default_tenant: &str,
) -> Result<ParsedRequest, BadRequest> {
    let (mut body, mut members) = parse_body(raw)?;
    // Refused whatever its content, for that reason first: the router alone
    // sets it (a field error alone about an incomplete object would suggest
    // a fix that still fails). A malformed one's bad field is named too.
    if let Some(p) = body.get("kv_transfer_params") {
        if p.is_null() {
            body.remove("kv_transfer_params");
            members.remove("kv_transfer_params");
        } else {
            let also = match KvParams::parse(p) {
                Ok(_) => String::new(),
                Err(e) => format!("; it is also malformed: {e}"),
            };
            return Err(bad(format!(
                "kv_transfer_params: set by the router from its conversation store; clients may not supply it (omit it or send null){also}"
            )));
        }
    }
    match api {
        Api::Completions if !body.contains_key("prompt") => return Err(bad("prompt: required")),
        Api::Chat if !body.get("messages").is_some_and(Value::is_array) => {
            return Err(bad("messages: expected an array of messages"));
        }
        _ => {}
    }
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    members.remove("conversation_id");
    let conversation_id = match body.remove("conversation_id") {
        Some(Value::String(c)) => Some(c),
        Some(Value::Null) | None => header("x-session-id"),
        Some(_) => return Err(bad("conversation_id: expected a string")),
    };
    let prompt_token_ids = match (api, body.get("prompt")) {
        (Api::Completions, Some(Value::Array(a))) if a.iter().all(Value::is_u64) => a
            .iter()
            .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => None,
    };
    let hidden_output =
        (body.get("include_reasoning") == Some(&Value::Bool(false))).then_some("hidden_reasoning");
    let has_stop_strings = match body.get("stop") {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        _ => false,
    };
    let stop_str_hidden =
        has_stop_strings && body.get("include_stop_str_in_output") != Some(&Value::Bool(true));
    Ok(ParsedRequest {
        api,
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        model: body
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string),
        body,
        members,
        conversation_id,
        tenant: tenant_of(headers, tenant_header, default_tenant),
        request_id: header("x-request-id"),
        prompt_token_ids,
        hidden_output,
        stop_str_hidden,
    })
}

/// The client's body as values and as raw members (see
/// [`ParsedRequest::members`]).
fn parse_body(raw: &[u8]) -> Result<(Map<String, Value>, RawObject), BadRequest> {
    let Ok(RawObject(received)) = RawObject::parse_slice(raw) else {
        // Only to say why (the error path): not an object, or not JSON.
        return Err(match serde_json::from_slice::<Value>(raw) {
            Ok(_) => bad("body: expected a JSON object"),
            Err(e) => bad(format!("body: invalid JSON: {e}")),
        });
    };
    let mut body = Map::new();
    for (k, v) in &received {
        let value = serde_json::from_str::<Value>(v.get())
            .map_err(|e| bad(format!("{k}: invalid JSON: {e}")))?;
        body.insert(k.clone(), value);
    }
    if body.len() == received.len() {
        return Ok((body, RawObject(received)));
    }
    // A key repeated: once, at its first place, with its last value.
    let mut at: HashMap<String, usize> = HashMap::with_capacity(body.len());
    let mut members: Vec<(String, Box<RawValue>)> = Vec::with_capacity(body.len());
    for (k, v) in received {
        match at.get(&k) {
            Some(&i) => members[i].1 = v,
            None => {
                at.insert(k.clone(), members.len());
                members.push((k, v));
            }
        }
    }
    Ok((body, RawObject(members)))
}

/// An override of one member of the client's body.
struct Override {
    key: &'static str,
    value: Value,
    /// Added when the client's body lacks the key (else only replaced).
    insert: bool,
}

/// `{"kv_transfer_params":<params>,...}`: `params` spliced in as its exact
/// text (a `serde_json::Value` would re-spell D's numbers), then the
/// members of `body` in order, without `kv_transfer_params` and the `drop`
/// keys, with `overrides` replacing (or, where `insert`, adding) theirs.
/// Written straight from the borrowed body: no copy of the client's
/// messages.
fn write_body(
    body: &RawObject,
    params: &RawValue,
    overrides: &[Override],
    drop: &[&str],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(params.get().len() + body.text_len() + 64);
    out.extend_from_slice(b"{\"kv_transfer_params\":");
    out.extend_from_slice(params.get().as_bytes());
    for (k, v) in &body.0 {
        if k == "kv_transfer_params" || drop.contains(&k.as_str()) {
            continue;
        }
        out.push(b',');
        match overrides.iter().find(|o| o.key == k) {
            Some(o) => write_member(&mut out, k, &o.value),
            None => json::write_member(&mut out, k, v),
        }
    }
    for o in overrides
        .iter()
        .filter(|o| o.insert && body.get(o.key).is_none())
    {
        out.push(b',');
        write_member(&mut out, o.key, &o.value);
    }
    out.push(b'}');
    out
}

/// `"key":value`, the value serialized.
fn write_member(out: &mut Vec<u8>, key: &str, value: &Value) {
    serde_json::to_writer(&mut *out, key).expect("a string serializes");
    out.push(b':');
    serde_json::to_writer(&mut *out, value).expect("a JSON value serializes");
}

/// The prefill request: the client's body as a one-token, non-streaming
/// generation (`max_tokens: 1`, `max_completion_tokens: 1` when set,
/// without `stream_options`, `min_tokens`, `min_completion_tokens`), with
/// `params` (D's on reuse, else the no-reuse shape).
pub fn prefill_body(body: &RawObject, params: &RawValue) -> Vec<u8> {
    let overrides = [
        Override {
            key: "stream",
            value: Value::Bool(false),
            insert: true,
        },
        Override {
            key: "max_tokens",
            value: Value::from(1),
            insert: true,
        },
        Override {
            key: "max_completion_tokens",
            value: Value::from(1),
            insert: false,
        },
    ];
    write_body(
        body,
        params,
        &overrides,
        &["stream_options", "min_tokens", "min_completion_tokens"],
    )
}

/// The decode request: the client's body with P's params.
pub fn decode_body(body: &RawObject, params: &RawValue) -> Vec<u8> {
    write_body(body, params, &[], &[])
}

/// The `/tokenize` request for a prompt (JSON bytes): `model` plus `prompt`
/// (completions) or the chat fields that shape the templated prompt, each
/// copied as the client sent it. `None` when a completions body has no
/// prompt.
pub fn tokenize_body(api: Api, body: &RawObject) -> Option<Vec<u8>> {
    const CHAT: &[&str] = &[
        "messages",
        "tools",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
    ];
    let keys: &[&str] = match api {
        Api::Completions => {
            body.get("prompt")?;
            &["prompt"]
        }
        Api::Chat => CHAT,
    };
    let mut out = Vec::with_capacity(body.text_len() + 2);
    out.push(b'{');
    for (k, v) in &body.0 {
        if k == "model" || keys.contains(&k.as_str()) {
            if out.len() > 1 {
                out.push(b',');
            }
            json::write_member(&mut out, k, v);
        }
    }
    out.push(b'}');
    Some(out)
}

/// The `/tokenize` request counting the tokens of a reply's visible text
/// (`add_special_tokens: false`), as JSON bytes.
pub fn tokenize_text_body(model: Option<&str>, text: &str) -> Vec<u8> {
    let mut req = Map::new();
    if let Some(m) = model {
        req.insert("model".into(), Value::from(m));
    }
    req.insert("prompt".into(), Value::from(text));
    req.insert("add_special_tokens".into(), Value::Bool(false));
    serde_json::to_vec(&req).expect("a JSON object serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(api: Api, v: Value) -> Result<ParsedRequest, BadRequest> {
        parse_request(
            api,
            &HeaderMap::new(),
            v.to_string().as_bytes(),
            "x-tenant-id",
            "default",
        )
    }

    #[test]
    fn parses_and_refuses_naming_the_field() {
        let r = parse(
            Api::Chat,
            json!({"messages": [], "conversation_id": "c", "stream": true}),
        )
        .unwrap();
        assert_eq!(r.conversation_id.as_deref(), Some("c"));
        assert!(r.stream && !r.body.contains_key("conversation_id"));
        assert_eq!(r.tenant, "default");
        for (api, v, field) in [
            (Api::Completions, json!({"x": 1}), "prompt"),
            (Api::Chat, json!({"messages": 1}), "messages"),
            (
                Api::Completions,
                json!({"prompt": "", "conversation_id": 3}),
                "conversation_id",
            ),
            (
                Api::Completions,
                json!({"prompt": "", "kv_transfer_params": {"remote_engine_id": 5}}),
                "kv_transfer_params: set by the router",
            ),
            (
                Api::Completions,
                json!({"prompt": "", "kv_transfer_params": {"remote_engine_id": 5}}),
                "also malformed: kv_transfer_params.remote_engine_id",
            ),
            (
                Api::Chat,
                json!({"messages": [], "kv_transfer_params": "abc"}),
                "kv_transfer_params: set by the router",
            ),
        ] {
            let e = parse(api, v).unwrap_err();
            assert!(e.0.contains(field), "{e}");
        }
        let e = parse(Api::Chat, json!({"messages": 1})).unwrap_err();
        assert_eq!(e.param(), Some("messages"));
        assert_eq!(BadRequest("body: invalid JSON: x".into()).param(), None);
        assert_eq!(BadRequest("no field here".into()).param(), None);
        let t = parse(Api::Completions, json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(t.prompt_token_ids, Some(vec![1, 2, 3]));
    }

    #[test]
    fn hidden_output_kinds() {
        let r = parse(
            Api::Chat,
            json!({"messages": [], "include_reasoning": false}),
        )
        .unwrap();
        assert_eq!(r.hidden_output, Some("hidden_reasoning"));
        let r = parse(Api::Chat, json!({"messages": [], "stop": ["END"]})).unwrap();
        assert!(r.stop_str_hidden && r.hidden_output.is_none());
        let r = parse(
            Api::Chat,
            json!({"messages": [], "stop": "END", "include_stop_str_in_output": true}),
        )
        .unwrap();
        assert!(!r.stop_str_hidden);
    }

    /// The engines get the client's members as it wrote them: its order,
    /// its spelling of numbers and strings; a repeated key once, with the
    /// value `body` reads.
    #[test]
    fn bodies_copy_the_clients_members_exactly() {
        let raw = r#"{"temperature":0.70,"messages":[{"role":"user","content":"caf\u00e9"}],"model":"m","n":1e0,"model":"m2","conversation_id":"c"}"#;
        let r = parse_request(Api::Chat, &HeaderMap::new(), raw.as_bytes(), "t", "d").unwrap();
        assert_eq!(r.body["model"], "m2");
        assert_eq!(r.model.as_deref(), Some("m2"));
        let params = RawValue::from_string("{}".into()).unwrap();
        let d = String::from_utf8(decode_body(&r.members, &params)).unwrap();
        assert_eq!(
            d,
            r#"{"kv_transfer_params":{},"temperature":0.70,"messages":[{"role":"user","content":"caf\u00e9"}],"model":"m2","n":1e0}"#
        );
        let t = String::from_utf8(tokenize_body(Api::Chat, &r.members).unwrap()).unwrap();
        assert_eq!(
            t,
            r#"{"messages":[{"role":"user","content":"caf\u00e9"}],"model":"m2"}"#
        );
        let c = RawObject::parse(r#"{"max_tokens":3,"prompt":[1,2]}"#).unwrap();
        let t = String::from_utf8(tokenize_body(Api::Completions, &c).unwrap()).unwrap();
        assert_eq!(t, r#"{"prompt":[1,2]}"#);
        assert!(tokenize_body(Api::Completions, &RawObject::default()).is_none());
        for bad_body in [&b"[1]"[..], b"{\"a\":", b"{\"a\":1e999}"] {
            let e = parse_request(Api::Chat, &HeaderMap::new(), bad_body, "t", "d").unwrap_err();
            assert!(e.0.starts_with("body: ") || e.0.starts_with("a: "), "{e}");
        }
    }

    #[test]
    fn prefill_and_decode_bodies_carry_params_exactly() {
        let body = RawObject::parse(
            r#"{"model": "m", "prompt": "x", "stream": true, "max_tokens": 9,
                          "stream_options": {"include_usage": true}, "min_tokens": 2}"#,
        )
        .unwrap();
        let params = RawValue::from_string(r#"{"t":1214.2449693849999}"#.into()).unwrap();
        let p = String::from_utf8(prefill_body(&body, &params)).unwrap();
        assert!(
            p.starts_with(r#"{"kv_transfer_params":{"t":1214.2449693849999},"#),
            "{p}"
        );
        let v: Value = serde_json::from_str(&p).unwrap();
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none() && v.get("min_tokens").is_none());
        let d: Value = serde_json::from_slice(&decode_body(&body, &params)).unwrap();
        assert_eq!(d["max_tokens"], 9);
        assert_eq!(d["stream"], true);
        let bare = RawObject::parse(
            r#"{"messages": [{"role": "user", "content": "a\"b"}],
                "max_completion_tokens": 7, "conversation_x": null}"#,
        )
        .unwrap();
        let p: Value = serde_json::from_slice(&prefill_body(&bare, &params)).unwrap();
        assert_eq!(p["stream"], false);
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["max_completion_tokens"], 1);
        assert_eq!(p["messages"], json!([{"role": "user", "content": "a\"b"}]));
        assert!(p["conversation_x"].is_null() && p.get("conversation_x").is_some());
        let d: Value = serde_json::from_slice(&decode_body(&bare, &params)).unwrap();
        assert_eq!(d["max_completion_tokens"], 7);
        assert!(d.get("max_tokens").is_none() && d.get("stream").is_none());
        let empty = decode_body(&RawObject::default(), &params);
        assert_eq!(empty, br#"{"kv_transfer_params":{"t":1214.2449693849999}}"#);
    }
}
