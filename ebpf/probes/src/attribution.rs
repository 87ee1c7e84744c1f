//! Attribution of a prefill sample to token counts from the request's head
//! bytes (captured in the kernel at the server's first receive): the router's
//! `X-KVLoop-Tokens: prompt=<N>,reused=<R>` header
//! ([`kvloop_router_api::TOKENS_HEADER`]).

use kvloop_router_api::TOKENS_HEADER;

/// Token counts announced by the router for one prefill request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenCounts {
    /// Prompt length, tokens.
    pub prompt_tokens: u64,
    /// Tokens P reads from D instead of computing (0 = full recompute).
    pub reused_tokens: u64,
}

impl TokenCounts {
    /// Tokens P computes: `prompt - reused` (saturating).
    pub fn computed_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.reused_tokens)
    }
}

/// Why a request could not be attributed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unattributed {
    /// No head bytes were captured (the server read with `recvmsg`/`readv`,
    /// or the capture failed).
    NoBytes,
    /// The header is absent from the captured bytes (not sent, or beyond the
    /// first [`kvloop_common::PREFILL_HEAD_LEN`] bytes).
    NoHeader,
    /// The header is present but malformed; the message names the bad field.
    Malformed(String),
}

/// Parses the header value `prompt=<N>,reused=<R>` (order free, spaces
/// allowed, unknown keys ignored). `reused` defaults to 0; `prompt` is required.
pub fn parse_tokens_value(v: &str) -> Result<TokenCounts, String> {
    let mut prompt = None;
    let mut reused = 0u64;
    for part in v.split(',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let (k, val) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}`: expected key=value"))?;
        let k = k.trim();
        let n = || {
            val.trim().parse::<u64>().map_err(|_| {
                format!(
                    "`{k}`: expected a non-negative integer, got `{}`",
                    val.trim()
                )
            })
        };
        match k {
            "prompt" => prompt = Some(n()?),
            "reused" => reused = n()?,
            _ => {}
        }
    }
    let prompt_tokens = prompt.ok_or_else(|| "`prompt`: missing".to_string())?;
    if reused > prompt_tokens {
        return Err(format!("`reused`: {reused} exceeds prompt={prompt_tokens}"));
    }
    Ok(TokenCounts {
        prompt_tokens,
        reused_tokens: reused,
    })
}

/// Finds the tokens header in the head of an HTTP/1.x request.
pub fn attribute(head: &[u8]) -> Result<TokenCounts, Unattributed> {
    if head.is_empty() {
        return Err(Unattributed::NoBytes);
    }
    // header section only: up to the blank line (or the captured end)
    let end = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(head.len());
    for line in head[..end].split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = line.split_at(colon);
        if name.eq_ignore_ascii_case(TOKENS_HEADER.as_bytes()) {
            let value = std::str::from_utf8(&value[1..])
                .map_err(|_| Unattributed::Malformed("header value is not UTF-8".into()))?;
            return parse_tokens_value(value).map_err(Unattributed::Malformed);
        }
    }
    Err(Unattributed::NoHeader)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_header_case_insensitively() {
        let req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-KVLoop-Tokens: prompt=1200, reused=1024\r\nContent-Length: 2\r\n\r\n{}";
        let t = attribute(req).unwrap();
        assert_eq!(t.prompt_tokens, 1200);
        assert_eq!(t.reused_tokens, 1024);
        assert_eq!(t.computed_tokens(), 176);
    }

    #[test]
    fn missing_and_malformed() {
        assert_eq!(attribute(b""), Err(Unattributed::NoBytes));
        assert_eq!(
            attribute(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            Err(Unattributed::NoHeader)
        );
        // header after the blank line (in the body) does not count
        assert_eq!(
            attribute(b"GET / HTTP/1.1\r\n\r\nx-kvloop-tokens: prompt=1"),
            Err(Unattributed::NoHeader)
        );
        match attribute(b"GET / HTTP/1.1\r\nx-kvloop-tokens: prompt=abc\r\n\r\n") {
            Err(Unattributed::Malformed(m)) => assert!(m.contains("prompt"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(
            parse_tokens_value("reused=3")
                .unwrap_err()
                .contains("prompt")
        );
        assert!(
            parse_tokens_value("prompt=3,reused=4")
                .unwrap_err()
                .contains("reused")
        );
        assert_eq!(parse_tokens_value("prompt=5").unwrap().reused_tokens, 0);
    }
}
