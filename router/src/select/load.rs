//! What the router knows of engine load from its own requests: outstanding
//! prefill tokens per prefill engine, in-flight decode streams per decode
//! engine, and each prefill engine's measured cost per token (an EWMA of
//! completed prefills). No I/O; times are passed in. Indexed by registry index.
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Weight of a new sample in the measured prefill cost (EWMA).
pub const EWMA_ALPHA: f64 = 0.2;

#[derive(Default)]
struct Engine {
    outstanding_prefill_tokens: AtomicU64,
    inflight_decode_streams: AtomicU32,
    /// f64 bits of ms per token; 0 = no sample yet.
    ms_per_token_bits: AtomicU64,
}

/// Per-engine load counters, shared by the request tasks.
pub struct LoadBook {
    engines: Vec<Engine>,
}

/// Outstanding prefill tokens on one engine while alive.
pub struct PrefillGuard {
    book: Arc<LoadBook>,
    engine: u16,
    tokens: u64,
}

impl Drop for PrefillGuard {
    fn drop(&mut self) {
        if let Some(e) = self.book.engines.get(usize::from(self.engine)) {
            e.outstanding_prefill_tokens
                .fetch_sub(self.tokens, Ordering::Relaxed);
        }
    }
}

/// One in-flight decode stream on one engine while alive.
pub struct DecodeGuard {
    book: Arc<LoadBook>,
    engine: u16,
}

impl Drop for DecodeGuard {
    fn drop(&mut self) {
        if let Some(e) = self.book.engines.get(usize::from(self.engine)) {
            e.inflight_decode_streams.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl LoadBook {
    /// Counters for `n` engines (the registry's size), all zero.
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            engines: (0..n).map(|_| Engine::default()).collect(),
        })
    }

    /// Count `tokens` outstanding on prefill engine `engine` until the guard
    /// drops. An unknown index counts nothing.
    pub fn begin_prefill(self: &Arc<Self>, engine: u16, tokens: u64) -> PrefillGuard {
        if let Some(e) = self.engines.get(usize::from(engine)) {
            e.outstanding_prefill_tokens
                .fetch_add(tokens, Ordering::Relaxed);
        }
        PrefillGuard {
            book: self.clone(),
            engine,
            tokens,
        }
    }

    /// Count one decode stream on `engine` until the guard drops.
    pub fn begin_decode(self: &Arc<Self>, engine: u16) -> DecodeGuard {
        if let Some(e) = self.engines.get(usize::from(engine)) {
            e.inflight_decode_streams.fetch_add(1, Ordering::Relaxed);
        }
        DecodeGuard {
            book: self.clone(),
            engine,
        }
    }

    /// A completed prefill of `tokens` computed tokens that took `elapsed_ms`
    /// on `engine`: updates its measured ms per token (EWMA, α =
    /// [`EWMA_ALPHA`]). Ignores empty or non-finite samples.
    pub fn record_prefill(&self, engine: u16, tokens: u64, elapsed_ms: f64) {
        let Some(e) = self.engines.get(usize::from(engine)) else {
            return;
        };
        if tokens == 0 || !elapsed_ms.is_finite() || elapsed_ms < 0.0 {
            return;
        }
        let sample = elapsed_ms / tokens as f64;
        let _ = e
            .ms_per_token_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = if bits == 0 {
                    sample
                } else {
                    old + EWMA_ALPHA * (sample - old)
                };
                Some(new.to_bits())
            });
    }

    /// Outstanding prefill tokens on `engine`.
    pub fn outstanding_prefill_tokens(&self, engine: u16) -> u64 {
        self.engines
            .get(usize::from(engine))
            .map_or(0, |e| e.outstanding_prefill_tokens.load(Ordering::Relaxed))
    }

    /// In-flight decode streams on `engine`.
    pub fn inflight_decode_streams(&self, engine: u16) -> u32 {
        self.engines
            .get(usize::from(engine))
            .map_or(0, |e| e.inflight_decode_streams.load(Ordering::Relaxed))
    }

    /// Measured prefill cost of `engine`, ms per token (`None` before the
    /// first sample).
    pub fn measured_ms_per_token(&self, engine: u16) -> Option<f64> {
        let bits = self
            .engines
            .get(usize::from(engine))?
            .ms_per_token_bits
            .load(Ordering::Relaxed);
        (bits != 0).then(|| f64::from_bits(bits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_count_while_alive() {
        let b = LoadBook::new(3);
        let g1 = b.begin_prefill(0, 100);
        let g2 = b.begin_prefill(0, 50);
        let d = b.begin_decode(2);
        assert_eq!(b.outstanding_prefill_tokens(0), 150);
        assert_eq!(b.inflight_decode_streams(2), 1);
        drop(g1);
        assert_eq!(b.outstanding_prefill_tokens(0), 50);
        drop((g2, d));
        assert_eq!(b.outstanding_prefill_tokens(0), 0);
        assert_eq!(b.inflight_decode_streams(2), 0);
        let _ = b.begin_prefill(9, 5); // unknown index: ignored
    }

    #[test]
    fn measured_cost_is_an_ewma() {
        let b = LoadBook::new(1);
        assert_eq!(b.measured_ms_per_token(0), None);
        b.record_prefill(0, 100, 10.0);
        assert_eq!(b.measured_ms_per_token(0), Some(0.1));
        b.record_prefill(0, 100, 20.0);
        let m = b.measured_ms_per_token(0).unwrap();
        assert!((m - 0.12).abs() < 1e-12, "{m}");
        b.record_prefill(0, 0, 5.0);
        b.record_prefill(0, 10, f64::NAN);
        assert_eq!(b.measured_ms_per_token(0), Some(m));
    }
}
