//! Inspection and rewriting of D's replies (router rules 2 and 4 of
//! `docs/protocol.md`). Pure: bytes in, bytes out.
//!
//! D's `kv_transfer_params` are internal (block ids, engine hosts and
//! ports): they are captured here, exactly as D wrote them, and removed from
//! what the client gets. In a stream, a chunk that carried them is rewritten
//! without them, and dropped when nothing is left that a client reads (no
//! `choices` entry and no `usage`): OpenAI-conformant clients read
//! `choices[0]` of every chunk. Every other event is forwarded byte for byte.
//!
//! [`StreamRewriter`] works event by event (the shared [`SseParser`]): an
//! event is forwarded once its closing blank line has arrived, which is when
//! a client would dispatch it anyway.
use kvloop_router_api::json::RawObject;
use kvloop_router_api::sse::{SseEvent, SseParser};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;
use serde_json::value::RawValue;
use std::borrow::Cow;

/// What a reply said, as far as the router cares.
#[derive(Debug, Clone, Default)]
pub struct ReplySummary {
    /// Top-level `kv_transfer_params` (last non-null one seen), exact text.
    pub kv_transfer_params: Option<Box<RawValue>>,
    /// `finish_reason` of choice 0.
    pub finish_reason: Option<String>,
    /// The answer text of choice 0 (content deltas or completion text).
    pub text: String,
    /// Reasoning or tool-call output appeared (the client may rewrite it).
    pub rewritable_output: bool,
    /// Choice 0 stopped on a stop string (`stop_reason` a string): unless the
    /// request set `include_stop_str_in_output`, D holds tokens the client
    /// never saw.
    pub stopped_on_string: bool,
    /// An error object (`{"error": ...}`) appeared in the reply.
    pub error: bool,
    /// `data: [DONE]` seen (streams only).
    pub done: bool,
    /// Number of choices seen beyond index 0 (n > 1 replies are not stored).
    pub extra_choices: bool,
    /// `usage.completion_tokens`, when reported.
    pub completion_tokens: Option<u64>,
}

impl ReplySummary {
    /// Finished with `stop` or `length`, no error, no rewritable output,
    /// single choice, and (streams) completed with `[DONE]`.
    pub fn storable(&self, streamed: bool) -> bool {
        matches!(self.finish_reason.as_deref(), Some("stop") | Some("length"))
            && !self.error
            && !self.rewritable_output
            && !self.extra_choices
            && (!streamed || self.done)
    }

    /// Why [`ReplySummary::storable`] is false (a `store_skipped` reason).
    pub fn skip_reason(&self, streamed: bool) -> &'static str {
        if self.error {
            "error_event"
        } else if self.rewritable_output {
            "rewritable_output"
        } else if streamed && !self.done {
            "incomplete_stream"
        } else {
            "abnormal_finish"
        }
    }

    /// Absorb one JSON object (a stream chunk or a whole response) and
    /// remove its `kv_transfer_params`. Returns whether it had them.
    pub fn absorb(&mut self, obj: &mut RawObject) -> bool {
        let params = obj.remove("kv_transfer_params");
        let had = params.is_some();
        if let Some(p) = params.filter(|p| p.get() != "null") {
            self.kv_transfer_params = Some(p);
        }
        let choices = parse(obj.get("choices"));
        let usage = parse(obj.get("usage"));
        let view = ChunkView::from_values(
            obj.get("error").is_some_and(|e| e.get() != "null"),
            choices.as_ref(),
            usage.as_ref(),
        );
        self.absorb_view(&view);
        had
    }

    /// The summary's rules, on one chunk's members as [`ChunkView`] holds
    /// them (read in one typed pass, or from `Value`s by
    /// [`ChunkView::from_values`]).
    fn absorb_view(&mut self, chunk: &ChunkView<'_>) {
        if chunk.error {
            self.error = true;
        }
        for Obj(c) in chunk.choices.iter().flatten() {
            if c.index.unwrap_or(0) != 0 {
                self.extra_choices = true;
                continue;
            }
            if let Some(f) = &c.finish_reason {
                self.finish_reason = Some(f.to_string());
            }
            if c.stop_reason_is_string {
                self.stopped_on_string = true;
            }
            if let Some(t) = &c.text {
                self.text.push_str(t);
            }
            for Obj(d) in [&c.delta, &c.message].into_iter().flatten() {
                if let Some(t) = &d.content {
                    self.text.push_str(t);
                }
                let reasoning = [&d.reasoning_content, &d.reasoning]
                    .into_iter()
                    .flatten()
                    .any(|r| !r.is_empty());
                if reasoning || d.tool_calls || d.function_call {
                    self.rewritable_output = true;
                }
            }
        }
        if let Some(n) = chunk.usage.as_ref().and_then(|u| u.0.completion_tokens) {
            self.completion_tokens = Some(n);
        }
    }
}

/// What the summary's rules read of one chunk, borrowed from it. Read in
/// one typed pass ([`ChunkView::parse`]): the fast path of
/// [`StreamRewriter`] (a chunk is parsed for every token D streams; through
/// [`RawObject`] and `Value` this cost about 6 % of the router's CPU in
/// `chat_bench`), which takes only chunks whose members have the types the
/// rules read, and none with `kv_transfer_params` (present, even `null`) or
/// a duplicate member (serde rejects those). Every other chunk takes the
/// general path, which builds the same view from `Value`s, reading a member
/// of another type as absent ([`ChunkView::from_values`]).
#[derive(serde::Deserialize)]
struct ChunkView<'a> {
    /// Absent: `None`; present (any value, `null` too): `Some`. Only the
    /// typed pass reads it (the general path removes the member first).
    #[serde(default, borrow, deserialize_with = "present")]
    kv_transfer_params: Option<Option<&'a RawValue>>,
    /// Present and not `null`.
    #[serde(default, deserialize_with = "non_null")]
    error: bool,
    #[serde(default, borrow)]
    choices: Option<Vec<Obj<ChoiceView<'a>>>>,
    #[serde(default)]
    usage: Option<Obj<UsageView>>,
}

#[derive(serde::Deserialize)]
struct ChoiceView<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
    #[serde(default, rename = "stop_reason", deserialize_with = "is_string")]
    stop_reason_is_string: bool,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<Obj<DeltaView<'a>>>,
    #[serde(default, borrow)]
    message: Option<Obj<DeltaView<'a>>>,
}

#[derive(serde::Deserialize)]
struct DeltaView<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning: Option<Cow<'a, str>>,
    /// A non-empty array.
    #[serde(default, deserialize_with = "non_empty_array")]
    tool_calls: bool,
    /// Present and not `null`.
    #[serde(default, deserialize_with = "non_null")]
    function_call: bool,
}

#[derive(serde::Deserialize)]
struct UsageView {
    #[serde(default)]
    completion_tokens: Option<u64>,
}

impl<'a> ChunkView<'a> {
    /// The chunk, when it is a JSON object that the fast path takes.
    fn parse(data: &'a str) -> Option<Self> {
        let Obj(chunk) = serde_json::from_str::<Obj<Self>>(data).ok()?;
        chunk.kv_transfer_params.is_none().then_some(chunk)
    }

    /// The view of a chunk's `error` (present and not `null`), `choices` and
    /// `usage` parsed as `Value`s; a member of another type than the rules
    /// read counts as absent, a choice that is not an object as an empty
    /// choice 0.
    fn from_values(error: bool, choices: Option<&'a Value>, usage: Option<&'a Value>) -> Self {
        let text = |v: &'a Value, k: &str| v.get(k).and_then(Value::as_str).map(Cow::Borrowed);
        let part = |d: &'a Value| DeltaView {
            content: text(d, "content"),
            reasoning_content: text(d, "reasoning_content"),
            reasoning: text(d, "reasoning"),
            tool_calls: d
                .get("tool_calls")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty()),
            function_call: d.get("function_call").is_some_and(|f| !f.is_null()),
        };
        let choice = |c: &'a Value| ChoiceView {
            index: c.get("index").and_then(Value::as_u64),
            finish_reason: text(c, "finish_reason"),
            stop_reason_is_string: c.get("stop_reason").is_some_and(Value::is_string),
            text: text(c, "text"),
            delta: c.get("delta").map(|d| Obj(part(d))),
            message: c.get("message").map(|d| Obj(part(d))),
        };
        ChunkView {
            kv_transfer_params: None,
            error,
            choices: choices
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|c| Obj(choice(c))).collect()),
            usage: usage.map(|u| {
                Obj(UsageView {
                    completion_tokens: u.get("completion_tokens").and_then(Value::as_u64),
                })
            }),
        }
    }
}

/// A member read only from a JSON object (serde's derived structs also take
/// arrays, which the `Value` rules read as holding nothing).
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for ObjVisitor<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(ObjVisitor(std::marker::PhantomData))
            .map(Obj)
    }
}

fn present<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Option<&'de RawValue>>, D::Error> {
    Option::<&'de RawValue>::deserialize(d).map(Some)
}

fn non_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Option::<&'de RawValue>::deserialize(d).map(|v| v.is_some())
}

fn is_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Option::<&'de RawValue>::deserialize(d).map(|v| v.is_some_and(|r| r.get().starts_with('"')))
}

/// Any other type than an array (or `null`) is refused: the chunk then
/// takes the general path.
fn non_empty_array<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Option::<Vec<IgnoredAny>>::deserialize(d).map(|v| v.is_some_and(|a| !a.is_empty()))
}

fn parse(raw: Option<&RawValue>) -> Option<Value> {
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
}

/// True when a chunk still carries something a client reads: a non-empty
/// `choices` array or a non-null `usage`.
fn readable(obj: &RawObject) -> bool {
    let choices = obj
        .get("choices")
        .is_some_and(|c| !matches!(c.get().trim(), "[]" | "null"));
    let usage = obj.get("usage").is_some_and(|u| u.get() != "null");
    choices || usage
}

/// A non-streaming reply: the summary and the body to send to the client
/// (without `kv_transfer_params`; other members exactly as D wrote them).
/// A body that is not a JSON object is returned unchanged.
pub fn rewrite_body(body: &[u8]) -> (ReplySummary, Option<Vec<u8>>) {
    let mut summary = ReplySummary::default();
    let Ok(mut obj) = RawObject::parse_slice(body) else {
        return (summary, None);
    };
    let had = summary.absorb(&mut obj);
    (summary, had.then(|| obj.to_json_bytes()))
}

/// Incremental SSE rewriter of D's stream.
#[derive(Debug, Default)]
pub struct StreamRewriter {
    parser: SseParser,
    /// What was seen so far.
    pub summary: ReplySummary,
    /// `data:` payloads that were not valid JSON (forwarded unchanged).
    pub unparsed_events: u64,
}

impl StreamRewriter {
    /// Feed the next bytes of D's stream; returns the bytes to forward now.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len());
        for ev in self.parser.push(chunk) {
            self.event(ev, &mut out);
        }
        out
    }

    /// End of D's stream: returns the bytes of an unterminated last event.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(ev) = self.parser.finish() {
            self.event(ev, &mut out);
        }
        out
    }

    fn event(&mut self, ev: SseEvent, out: &mut Vec<u8>) {
        let Some(data) = ev.data.as_deref() else {
            out.extend_from_slice(&ev.raw);
            return;
        };
        if data.trim() == "[DONE]" {
            self.summary.done = true;
            out.extend_from_slice(&ev.raw);
            return;
        }
        if let Some(chunk) = ChunkView::parse(data) {
            // No `kv_transfer_params` member: nothing to rewrite.
            self.summary.absorb_view(&chunk);
            out.extend_from_slice(&ev.raw);
            return;
        }
        let Ok(mut obj) = RawObject::parse(data) else {
            self.unparsed_events += 1;
            out.extend_from_slice(&ev.raw);
            return;
        };
        if !self.summary.absorb(&mut obj) {
            out.extend_from_slice(&ev.raw);
            return;
        }
        if readable(&obj) {
            if let Some(e) = &ev.event {
                out.extend_from_slice(format!("event: {e}\n").as_bytes());
            }
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(&obj.to_json_bytes());
            out.extend_from_slice(b"\n\n");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"he\"},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"llo\"},\"logprobs\":{\"x\":-0.10000000000000001},\"finish_reason\":null}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"choices\":[],\"kv_transfer_params\":{\"remote_engine_id\":\"d0\",\"t\":1214.2449693849999}}\n\n",
        "data: [DONE]\n\n"
    );

    fn run(stream: &str, split: usize) -> (StreamRewriter, String) {
        let mut s = StreamRewriter::default();
        let mut out = Vec::new();
        for c in stream.as_bytes().chunks(split) {
            out.extend(s.feed(c));
        }
        out.extend(s.finish());
        (s, String::from_utf8(out).unwrap())
    }

    #[test]
    fn params_only_chunk_is_captured_exactly_and_dropped() {
        for split in [1, 3, 7, 64, 1000] {
            let (s, out) = run(STREAM, split);
            assert_eq!(s.summary.text, "hello");
            assert_eq!(
                s.summary.kv_transfer_params.as_ref().unwrap().get(),
                r#"{"remote_engine_id":"d0","t":1214.2449693849999}"#
            );
            assert!(s.summary.storable(true));
            assert!(!out.contains("kv_transfer_params"), "{out}");
            let without = STREAM.replace(
                "data: {\"choices\":[],\"kv_transfer_params\":{\"remote_engine_id\":\"d0\",\"t\":1214.2449693849999}}\n\n",
                "",
            );
            assert_eq!(out, without, "other events forwarded byte for byte");
        }
    }

    #[test]
    fn params_on_the_finish_chunk_are_stripped_and_the_chunk_kept() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"kv_transfer_params\":{\"remote_engine_id\":\"d0\"}}\r\n\r\n",
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":3},\"kv_transfer_params\":null}\n\n",
            "data: [DONE]\n\n"
        );
        let (s, out) = run(stream, 5);
        assert!(s.summary.storable(true));
        assert!(s.summary.kv_transfer_params.is_some());
        assert_eq!(s.summary.completion_tokens, Some(3));
        assert!(!out.contains("kv_transfer_params"), "{out}");
        assert!(out.contains("\"finish_reason\":\"length\""), "{out}");
        assert!(
            out.contains("\"usage\":{\"completion_tokens\":3}"),
            "usage chunks pass"
        );
        for line in out.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(line).unwrap();
            assert!(
                v["choices"].get(0).is_some() || !v["usage"].is_null(),
                "{line}"
            );
        }
    }

    #[test]
    fn error_event_is_never_storable() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"error\":{\"message\":\"engine died\",\"code\":500}}\n\n",
            "data: {\"choices\":[],\"kv_transfer_params\":{\"remote_engine_id\":\"d0\"}}\n\n",
            "data: [DONE]\n\n"
        );
        let (s, out) = run(stream, 9);
        assert!(s.summary.error);
        assert!(!s.summary.storable(true));
        assert_eq!(s.summary.skip_reason(true), "error_event");
        assert!(out.contains("engine died"), "errors reach the client");
    }

    #[test]
    fn not_storable_without_done_or_with_tool_calls() {
        let mut s = StreamRewriter::default();
        s.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
        assert!(!s.summary.storable(true));
        s.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\ndata: [DONE]\n\n");
        assert!(!s.summary.storable(true));
        let mut r = StreamRewriter::default();
        r.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"abort\"}]}\n\ndata: [DONE]\n\n");
        assert!(!r.summary.storable(true));
    }

    /// The fast path takes a chunk only where it reads it as the general
    /// path does.
    #[test]
    fn fast_path_summary_equals_the_general_one() {
        let chunks = [
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"h\u00e9\n"},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"text":"x","finish_reason":"length","stop_reason":null}],"usage":null}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":"</s>"}],"usage":{"prompt_tokens":3,"completion_tokens":7}}"#,
            r#"{"choices":[{"index":1,"delta":{"content":"other"}}]}"#,
            r#"{"choices":[{"index":null,"delta":{"content":"a","reasoning_content":""}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning":"think"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}"#,
            r#"{"choices":[{"index":0,"message":{"content":"m","function_call":null}}]}"#,
            r#"{"choices":[{"index":0,"message":{"function_call":{"name":"f"}}}]}"#,
            r#"{"error":null,"choices":[]}"#,
            r#"{"error":{"message":"boom"}}"#,
            // Shapes only the general path reads (the fast path declines):
            r#"{"choices":[[0,"stop"]]}"#,
            r#"{"choices":[{"index":"0","delta":{"content":"s"}}]}"#,
            r#"{"choices":[{"index":0,"finish_reason":3,"delta":{"content":"n"}}]}"#,
            r#"{"choices":[{"index":0,"delta":"text"}]}"#,
            r#"{"choices":{"index":0}}"#,
            r#"{"usage":{"completion_tokens":-1}}"#,
            r#"{"choices":[{"index":0,"text":"a","text":"b"}]}"#,
            r#"{"kv_transfer_params":null,"choices":[]}"#,
            r#"{"kv_transfer_params":{"remote_engine_id":"d0"}}"#,
            r#"[null,null,[],null]"#,
        ];
        let mut fast = 0;
        for data in chunks {
            let mut general = ReplySummary::default();
            if let Ok(mut obj) = RawObject::parse(data) {
                general.absorb(&mut obj);
            }
            if let Some(view) = ChunkView::parse(data) {
                fast += 1;
                let mut viewed = ReplySummary::default();
                viewed.absorb_view(&view);
                assert_eq!(format!("{viewed:?}"), format!("{general:?}"), "{data}");
            }
        }
        assert_eq!(fast, 12, "the first 12 chunks take the fast path");
    }

    #[test]
    fn body_without_params_keeps_numbers_exact() {
        let body = br#"{"id":"x","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop","logprobs":{"v":-0.10000000000000001}}],"kv_transfer_params":{"remote_engine_id":"d0"}}"#;
        let (s, out) = rewrite_body(body);
        let out = String::from_utf8(out.unwrap()).unwrap();
        assert_eq!(
            out,
            r#"{"id":"x","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop","logprobs":{"v":-0.10000000000000001}}]}"#
        );
        assert!(s.storable(false));
        assert_eq!(s.text, "hi");
        let (_, unchanged) = rewrite_body(b"{\"choices\":[]}");
        assert!(unchanged.is_none(), "no params: forwarded as is");
    }
}
