//! Incremental parser of `text/event-stream` bodies (the HTML Living
//! Standard's "Server-sent events" section, "Parsing an event stream"). Pure:
//! bytes in, events out, no I/O.
//!
//! Used by the router (which inspects and forwards D's stream event by event)
//! and by the load generator (which reads the answers).
//!
//! Per the standard: lines end with CRLF, LF or CR (a CR at the end of one
//! push followed by LF at the start of the next is one line end); a blank
//! line dispatches the event; a line starting with `:` is a comment; a line
//! without `:` is a field with an empty value; one space after the colon is
//! removed; the `data` lines of one event are joined with `\n`; a UTF-8 BOM
//! at the start of the stream is ignored. Unlike a browser, every block is
//! reported (also those without `data`), with its raw bytes, so a relay can
//! forward the stream unchanged.

/// One event block: the lines up to and including the blank line that ends it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The bytes of the block exactly as received (line ends included).
    pub raw: Vec<u8>,
    /// The `data` lines joined by `\n`; `None` when the block had no `data`
    /// field (comments, keep-alives: a browser dispatches nothing for them).
    pub data: Option<String>,
    /// The `event` field, when set.
    pub event: Option<String>,
}

/// The parser: feed body bytes with [`SseParser::push`] as they arrive, call
/// [`SseParser::finish`] at the end of the body.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the current, unfinished line.
    line: Vec<u8>,
    /// Raw bytes of the current block so far.
    raw: Vec<u8>,
    data: Option<String>,
    event: Option<String>,
    /// The previous byte was a CR ending a line: skip one LF.
    skip_lf: bool,
    /// Still at the very start of the stream (a BOM may follow).
    at_start: bool,
    started: bool,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

impl SseParser {
    /// An empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed bytes; returns the blocks completed by them, in order.
    ///
    /// Scans for line ends with `memchr` and copies whole runs of bytes (a
    /// relay feeds every byte of D's stream through here; byte by byte it
    /// cost about 6 % of the router's CPU in `chat_bench`).
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            self.at_start = true;
        }
        let mut rest = bytes;
        if self.skip_lf && !rest.is_empty() {
            // The CR that ended the last push ended a line already.
            self.skip_lf = false;
            if rest[0] == b'\n' {
                self.raw.push(b'\n');
                rest = &rest[1..];
            }
        }
        while let Some(i) = memchr::memchr2(b'\r', b'\n', rest) {
            self.line.extend_from_slice(&rest[..i]);
            let mut end = i + 1;
            if rest[i] == b'\r' {
                match rest.get(end) {
                    Some(b'\n') => end += 1,
                    Some(_) => {}
                    None => self.skip_lf = true,
                }
            }
            self.raw.extend_from_slice(&rest[..end]);
            self.end_line(&mut out);
            rest = &rest[end..];
        }
        self.line.extend_from_slice(rest);
        self.raw.extend_from_slice(rest);
        out
    }

    /// End of the body: a last line without line end is processed, and a
    /// block not closed by a blank line is returned (a browser would drop
    /// it; a relay still has to forward its bytes).
    pub fn finish(&mut self) -> Option<SseEvent> {
        // A last line that is empty (or only the BOM) is no blank line: it
        // has no line end, so it dispatches nothing.
        let line = std::mem::take(&mut self.line);
        if let Some(start) = self.line_start(&line) {
            self.field(&line[start..]);
        }
        if self.raw.is_empty() {
            return None;
        }
        Some(self.take_event())
    }

    fn take_event(&mut self) -> SseEvent {
        // The next block is likely as long as this one (a stream's chunks
        // are alike): one allocation instead of a doubling series.
        let next = Vec::with_capacity(self.raw.len());
        SseEvent {
            raw: std::mem::replace(&mut self.raw, next),
            data: self.data.take(),
            event: self.event.take(),
        }
    }

    fn end_line(&mut self, out: &mut Vec<SseEvent>) {
        let mut line = std::mem::take(&mut self.line);
        match self.line_start(&line) {
            Some(start) => self.field(&line[start..]),
            None => out.push(self.take_event()),
        }
        line.clear();
        self.line = line; // keeps its capacity for the next line
    }

    /// Where the current line's content starts (after the stream's BOM);
    /// `None` when it is empty. Clears `at_start`.
    fn line_start(&mut self, line: &[u8]) -> Option<usize> {
        let mut start = 0;
        if self.at_start {
            self.at_start = false;
            if line.starts_with(BOM) {
                start = BOM.len();
            }
        }
        (line.len() > start).then_some(start)
    }

    /// A non-empty line: a comment or a field.
    fn field(&mut self, line: &[u8]) {
        if line[0] == b':' {
            return; // comment
        }
        let (name, value) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        let value = String::from_utf8_lossy(value);
        match name {
            b"data" => match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(&value);
                }
                None => self.data = Some(value.into_owned()),
            },
            b"event" => self.event = Some(value.into_owned()),
            _ => {} // id, retry and unknown fields: not needed here
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for c in chunks {
            out.extend(p.push(c));
        }
        out.extend(p.finish());
        out
    }

    #[test]
    fn multi_line_data_is_joined_with_newlines() {
        let ev = all(&[b"data: {\"a\":\ndata: 1}\n\n"]);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].data.as_deref(), Some("{\"a\":\n1}"));
        assert_eq!(ev[0].raw, b"data: {\"a\":\ndata: 1}\n\n");
    }

    #[test]
    fn every_line_end_kind_and_splits_between_cr_and_lf() {
        let stream: &[u8] =
            b"data: a\r\n\r\ndata: b\r\rdata:c\n\n: keep-alive\n\nevent: x\ndata\n\n";
        for split in 1..stream.len() {
            let chunks: Vec<&[u8]> = stream.chunks(split).collect();
            let ev = all(&chunks);
            let data: Vec<Option<&str>> = ev.iter().map(|e| e.data.as_deref()).collect();
            assert_eq!(
                data,
                vec![Some("a"), Some("b"), Some("c"), None, Some("")],
                "split {split}"
            );
            assert_eq!(ev[4].event.as_deref(), Some("x"));
            let raw: Vec<u8> = ev.iter().flat_map(|e| e.raw.clone()).collect();
            assert_eq!(raw, stream, "raw bytes are kept exactly (split {split})");
        }
    }

    #[test]
    fn bom_space_and_unterminated_tail() {
        let ev = all(&[b"\xEF\xBB\xBFdata:  two spaces\n\ndata: tail"]);
        assert_eq!(ev[0].data.as_deref(), Some(" two spaces"));
        assert_eq!(ev[1].data.as_deref(), Some("tail"));
        assert_eq!(ev[1].raw, b"data: tail");
    }

    #[test]
    fn a_crlf_blank_line_stays_with_its_event() {
        let ev = all(&[b"data: a\r\n\r\ndata: b\r\n\r\n"]);
        assert_eq!(ev[0].raw, b"data: a\r\n\r\n");
        assert_eq!(ev[1].raw, b"data: b\r\n\r\n");
    }

    /// Found by `make fuzz` (target `sse`): a stream of only the BOM, with
    /// no line end, lost its bytes (and failed a debug assertion).
    #[test]
    fn a_stream_of_only_the_bom_keeps_its_bytes() {
        for chunks in [&[&b"\xEF\xBB\xBF"[..]][..], &[b"\xEF", b"\xBB\xBF"]] {
            let ev = all(chunks);
            assert_eq!(ev.len(), 1, "{ev:?}");
            assert_eq!(ev[0].raw, b"\xEF\xBB\xBF");
            assert_eq!(
                (ev[0].data.as_deref(), ev[0].event.as_deref()),
                (None, None)
            );
        }
    }
}
