//! Inspection of D's replies (PROTOCOL.md Router rules 2 and 4). Pure.
//!
//! [`StreamInspector`] is fed the SSE bytes as they are forwarded (it never
//! holds them back) and keeps only an incomplete trailing line. Per `data:`
//! line it records the top-level `kv_transfer_params`, the finish reason, the
//! answer text, whether reasoning or tool-call output appeared, and `[DONE]`.
use serde_json::Value;

/// What a reply said, as far as the router cares.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplySummary {
    /// Top-level `kv_transfer_params` (last non-null one seen).
    pub kv_transfer_params: Option<Value>,
    /// `finish_reason` of choice 0.
    pub finish_reason: Option<String>,
    /// The answer text of choice 0 (content deltas or completion text).
    pub text: String,
    /// Reasoning or tool-call output appeared (the client may rewrite it).
    pub rewritable_output: bool,
    /// `data: [DONE]` seen (streams only).
    pub done: bool,
    /// Number of choices seen beyond index 0 (n > 1 replies are not stored).
    pub extra_choices: bool,
}

impl ReplySummary {
    /// Finished with `stop` or `length`, no rewritable output, single choice.
    pub fn storable(&self, streamed: bool) -> bool {
        matches!(self.finish_reason.as_deref(), Some("stop") | Some("length"))
            && !self.rewritable_output
            && !self.extra_choices
            && (!streamed || self.done)
    }

    fn absorb_choice(&mut self, c: &Value) {
        if c.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
            self.extra_choices = true;
            return;
        }
        if let Some(f) = c.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(f.to_string());
        }
        if let Some(t) = c.get("text").and_then(Value::as_str) {
            self.text.push_str(t);
        }
        for part in ["delta", "message"] {
            let Some(d) = c.get(part) else { continue };
            if let Some(t) = d.get("content").and_then(Value::as_str) {
                self.text.push_str(t);
            }
            for r in ["reasoning_content", "reasoning"] {
                if d.get(r)
                    .and_then(Value::as_str)
                    .is_some_and(|s| !s.is_empty())
                {
                    self.rewritable_output = true;
                }
            }
            if d.get("tool_calls")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
            {
                self.rewritable_output = true;
            }
            if d.get("function_call").is_some_and(|f| !f.is_null()) {
                self.rewritable_output = true;
            }
        }
    }

    /// Absorb one JSON object (a stream chunk or a whole response).
    pub fn absorb(&mut self, v: &Value) {
        if let Some(p) = v.get("kv_transfer_params").filter(|p| !p.is_null()) {
            self.kv_transfer_params = Some(p.clone());
        }
        if let Some(choices) = v.get("choices").and_then(Value::as_array) {
            for c in choices {
                self.absorb_choice(c);
            }
        }
    }
}

/// Incremental SSE inspector.
#[derive(Debug, Default)]
pub struct StreamInspector {
    partial: Vec<u8>,
    /// What was seen so far.
    pub summary: ReplySummary,
    /// Bytes of `data:` lines that were not valid JSON (ignored).
    pub unparsed_lines: u64,
}

impl StreamInspector {
    /// Feed the next bytes of the stream.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let (line, tail) = rest.split_at(nl);
            rest = &tail[1..];
            if self.partial.is_empty() {
                self.line(line);
            } else {
                let mut l = std::mem::take(&mut self.partial);
                l.extend_from_slice(line);
                self.line(&l);
            }
        }
        self.partial.extend_from_slice(rest);
    }

    /// End of stream: process a last line without newline.
    pub fn finish(&mut self) {
        if !self.partial.is_empty() {
            let l = std::mem::take(&mut self.partial);
            self.line(&l);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if data == b"[DONE]" {
            self.summary.done = true;
            return;
        }
        match serde_json::from_slice::<Value>(data) {
            Ok(v) => self.summary.absorb(&v),
            Err(_) => self.unparsed_lines += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_params_from_final_chunk_across_split_reads() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"he\"},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"llo\"},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"kv_transfer_params\":{\"remote_engine_id\":\"d0\"}}\n\n",
            "data: [DONE]\n\n"
        );
        for split in [1, 3, 7, 64, 1000] {
            let mut s = StreamInspector::default();
            for c in stream.as_bytes().chunks(split) {
                s.feed(c);
            }
            s.finish();
            assert_eq!(s.summary.text, "hello");
            assert_eq!(
                s.summary.kv_transfer_params.as_ref().unwrap()["remote_engine_id"],
                "d0"
            );
            assert!(s.summary.storable(true));
        }
    }

    #[test]
    fn not_storable_without_done_or_with_tool_calls() {
        let mut s = StreamInspector::default();
        s.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
        assert!(!s.summary.storable(true));
        s.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\ndata: [DONE]\n\n");
        assert!(!s.summary.storable(true));
        let mut r = StreamInspector::default();
        r.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"abort\"}]}\n\ndata: [DONE]\n\n");
        assert!(!r.summary.storable(true));
    }
}
