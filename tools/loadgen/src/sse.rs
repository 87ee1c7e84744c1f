//! Server-sent events of an OpenAI-compatible streaming chat completion,
//! parsed without I/O (bytes in, events out).
use serde_json::Value;

/// Incremental SSE parser: feed body bytes as they arrive, get the `data:`
/// payload of every complete event (multi-line data joined by `\n`).
/// Comments (`:` lines), events without data and other fields (`event:`,
/// `id:`) are ignored. A thin adapter over the one SSE parser of kvloop,
/// [`kvloop_router_api::sse::SseParser`] (line ends CRLF, LF or CR, a BOM at
/// the start ignored, per the SSE standard).
#[derive(Debug, Default)]
pub struct SseParser {
    inner: kvloop_router_api::sse::SseParser,
}

impl SseParser {
    /// An empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the data payloads of the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.inner
            .push(bytes)
            .into_iter()
            .filter_map(|e| e.data)
            .collect()
    }

    /// Ends the stream: returns a last event not closed by a blank line.
    pub fn finish(&mut self) -> Option<String> {
        self.inner.finish().and_then(|e| e.data)
    }
}

/// What one `chat.completion.chunk` carries that the client records.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChunkInfo {
    /// `choices[0].delta.content` (empty when absent).
    pub content: String,
    /// `choices[0].delta.reasoning_content` or `.reasoning` (empty when absent).
    pub reasoning: String,
    /// `usage.prompt_tokens`, when the chunk carries usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`, when the chunk carries usage.
    pub completion_tokens: Option<u64>,
    /// `choices[0].finish_reason`, when set.
    pub finish_reason: Option<String>,
}

/// One parsed data payload.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// `[DONE]`.
    Done,
    /// A chunk.
    Chunk(ChunkInfo),
    /// A JSON error object (`{"error": ...}`) sent in the stream.
    Error(String),
}

/// Interprets one data payload. Errors: the payload is neither `[DONE]` nor JSON.
pub fn parse_event(data: &str) -> Result<StreamEvent, String> {
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(StreamEvent::Done);
    }
    let v: Value = serde_json::from_str(data)
        .map_err(|e| format!("stream chunk is not JSON ({e}): {data:.200}"))?;
    if let Some(err) = v.get("error") {
        return Ok(StreamEvent::Error(err.to_string()));
    }
    let choice = v.get("choices").and_then(|c| c.get(0));
    let delta = choice.and_then(|c| c.get("delta"));
    let text = |k: &str| {
        delta
            .and_then(|d| d.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
    };
    let reasoning = if text("reasoning_content").is_empty() {
        text("reasoning")
    } else {
        text("reasoning_content")
    };
    let usage = v.get("usage").filter(|u| u.is_object());
    Ok(StreamEvent::Chunk(ChunkInfo {
        content: text("content").to_string(),
        reasoning: reasoning.to_string(),
        prompt_tokens: usage
            .and_then(|u| u.get("prompt_tokens"))
            .and_then(Value::as_u64),
        completion_tokens: usage
            .and_then(|u| u.get("completion_tokens"))
            .and_then(Value::as_u64),
        finish_reason: choice
            .and_then(|c| c.get("finish_reason"))
            .and_then(Value::as_str)
            .map(str::to_string),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_across_pushes_and_crlf() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"a\"").is_empty());
        let ev = p.push(b":1}\r\n\r\n: comment\n\ndata: [DONE]\n\n");
        assert_eq!(ev, vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(p.finish(), None);
        let mut p = SseParser::new();
        assert_eq!(
            p.push(b"data: {\"a\":\ndata: 1}\r\rdata: x"),
            vec!["{\"a\":\n1}"]
        );
        assert_eq!(p.finish().as_deref(), Some("x"));
    }

    #[test]
    fn chunk_fields() {
        let e = parse_event(r#"{"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}"#)
            .unwrap();
        let StreamEvent::Chunk(c) = e else { panic!() };
        assert_eq!(c.content, "hi");
        let e = parse_event(r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#)
            .unwrap();
        let StreamEvent::Chunk(c) = e else { panic!() };
        assert_eq!((c.prompt_tokens, c.completion_tokens), (Some(5), Some(7)));
        assert_eq!(parse_event("[DONE]").unwrap(), StreamEvent::Done);
        assert!(parse_event("nope").is_err());
    }
}
