//! D's answer to the client, and the turn stored from it.
//!
//! [`Relay`] forwards D's stream event by event through the
//! [`StreamRewriter`] (D's `kv_transfer_params` removed); at the end of the
//! stream it stores the turn ([`StoreCtx::finish`]) before the client sees
//! the end of the body. A stream D broke, or a client that went away, stores
//! nothing.
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use futures_util::Stream;
use tracing::{debug, warn};

use crate::config::PrefixCheckMode;
use crate::fingerprint::{Fingerprint, HistoryHasher};
use crate::metrics::{EngineLabel, ReasonLabel};
use crate::params::KvParams;
use crate::request::{Api, tokenize_text_body};
use crate::select::load::DecodeGuard;
use crate::sse::{ReplySummary, StreamRewriter};
use crate::state::AppState;
use crate::store::{ConvKey, StoredTurn};

/// What a finished turn needs to be stored.
pub struct StoreCtx {
    /// The router.
    pub state: Arc<AppState>,
    /// The conversation.
    pub key: ConvKey,
    /// Registry index of the D that answered.
    pub decode_engine: u16,
    /// Registry index of the P whose `/tokenize` counted the prompt.
    pub prefill_engine: u16,
    /// The prompt's token ids (count, hash), when known.
    pub tokens: Option<(u32, u64)>,
    /// The prompt's history hasher (the answer is added on finish).
    pub history: Option<HistoryHasher>,
    /// Endpoint.
    pub api: Api,
    /// `model` of the request.
    pub model: Option<String>,
    /// Why the request alone makes D hold tokens the client cannot see.
    pub hidden_output: Option<&'static str>,
    /// Stop strings are excluded from the text.
    pub stop_str_hidden: bool,
}

impl StoreCtx {
    fn skip(&self, reason: &'static str) {
        self.state
            .metrics
            .store_skipped
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Store D's params for the conversation's next turn, when the answer
    /// allows it: finished with `stop`/`length`, (streams) completed with
    /// `[DONE]`, no error event, nothing D holds that the history the client
    /// sends back lacks, params from the D that answered.
    pub async fn finish(self, summary: ReplySummary, streamed: bool) {
        let s = self.state.clone();
        if !summary.storable(streamed) {
            self.skip(summary.skip_reason(streamed));
            return;
        }
        if let Some(reason) = self.hidden_output {
            self.skip(reason);
            return;
        }
        if self.stop_str_hidden && summary.stopped_on_string {
            self.skip("hidden_stop_string");
            return;
        }
        let Some(raw) = &summary.kv_transfer_params else {
            self.skip("no_params");
            s.params_missing(self.decode_engine, streamed);
            return;
        };
        s.params_present();
        let params = match KvParams::parse_json(raw.get()) {
            Ok(p) => p,
            Err(e) => {
                if let Some(suppressed) = s.decode_params_rejected("source_decode") {
                    warn!(error = %e, suppressed, "decode engine returned malformed kv_transfer_params; not stored");
                }
                return;
            }
        };
        let Some(idx) = s.registry.index_of(&params.remote_engine_id) else {
            if let Some(suppressed) = s.decode_params_rejected("unknown_engine") {
                warn!(engine = %params.remote_engine_id, suppressed, "kv_transfer_params from an unregistered engine; not stored");
            }
            return;
        };
        if idx != self.decode_engine {
            if let Some(suppressed) = s.decode_params_rejected("source_decode") {
                warn!(engine = %params.remote_engine_id, suppressed, "kv_transfer_params name another engine than the decode engine that answered; not stored");
            }
            return;
        }
        let Some(held) = params.remote_num_tokens.and_then(|n| u32::try_from(n).ok()) else {
            self.skip("no_remote_num_tokens");
            return;
        };
        if let Some((n_prompt, _)) = self.tokens
            && s.prefix_check_in_force() == PrefixCheckMode::Tokens
        {
            // D holds prompt + generated − 1 tokens; the client can only send
            // back the prompt and the visible reply.
            let body = tokenize_text_body(self.model.as_deref(), &summary.text);
            // Bounded: the client's stream ends only after this check.
            let timeout = Duration::from_millis(s.cfg.health_timeout_ms.max(1_000));
            match s.tokenize_on(self.prefill_engine, body, timeout).await {
                Some(visible) if u64::from(held) <= u64::from(n_prompt) + visible.len() as u64 => {}
                Some(visible) => {
                    debug!(
                        held,
                        n_prompt,
                        visible = visible.len(),
                        "D holds more tokens than the visible history; not stored"
                    );
                    self.skip("hidden_tokens");
                    return;
                }
                None => {
                    self.skip("unverifiable_tokens");
                    return;
                }
            }
        }
        let mut fp = Fingerprint::default();
        if let Some((n, h)) = self.tokens {
            fp.tokens_len = n;
            fp.tokens_hash = h;
        }
        if let Some(mut hist) = self.history {
            match self.api {
                Api::Chat => hist.assistant(&summary.text),
                Api::Completions => hist.text(&summary.text),
            }
            (fp.history_len, fp.history_hash) = hist.finish();
        }
        s.store_turn(
            self.key,
            StoredTurn {
                params: params.compact(),
                decode_engine: idx,
                remote_num_tokens: held,
                fingerprint: fp,
                expires_at_ms: 0,
                stored_at_unix_ms: crate::clock::unix_ms(),
            },
            self.prefill_engine,
        )
        .await;
    }
}

impl AppState {
    /// Decode params not stored for `reason` (the label of
    /// `kvloop_router_params_rejected_total`): counted; `Some(n)` when a
    /// warning is due (at most one per reason per
    /// [`crate::alarms::WARN_EVERY_MS`]), `n` the rejections not warned
    /// about since the last one. A D that keeps answering the same wrong
    /// params (e.g. an empty block list from a full KV cache) would
    /// otherwise log at the request rate.
    fn decode_params_rejected(&self, reason: &'static str) -> Option<u64> {
        self.metrics.reject_params(reason);
        let now = self.now_ms();
        self.rejected_params_warn
            .lock()
            .entry(reason)
            .or_default()
            .occurred(now)
    }

    /// A storable decode answer without params: counted, warned about
    /// (rate-limited), reported in `/health`.
    fn params_missing(&self, decode_engine: u16, streamed: bool) {
        let engine_id = self
            .registry
            .get(decode_engine)
            .map(|e| e.engine_id.clone())
            .unwrap_or_default();
        self.metrics
            .decode_params_missing
            .get_or_create(&EngineLabel {
                engine_id: engine_id.clone(),
            })
            .inc();
        let now = self.now_ms();
        if self.missing_params.lock().missing(now) {
            warn!(decode = %engine_id, streamed, "decode answer carried no kv_transfer_params: this conversation will not reuse KV. Likely cause: {}", crate::alarms::MISSING_PARAMS_HINT);
        }
    }

    fn params_present(&self) {
        self.missing_params.lock().present();
    }
}

/// Most bytes a relay gathers before it hands them to the client
/// connection (64 KiB): a bound on what coalescing holds back.
pub const COALESCE_MAX_BYTES: usize = 64 << 10;

/// Yields in a row without new bytes before a relay forwards what it
/// gathered: hyper's client connection task needs two scheduler passes to
/// hand over its next decoded chunk (measured in `router/tests/relay_coalesce.rs`).
pub const COALESCE_YIELDS: u8 = 2;

/// Forwards D's SSE stream without its `kv_transfer_params`.
///
/// **Coalescing.** hyper's client body hands D's chunks over one at a time
/// (a channel of one), so a relay that returned each chunk at once made the
/// client connection write each SSE event with its own `writev`, even when
/// D's whole answer had arrived in one read (measured in `chat_bench`: 18
/// writes per 16-token answer, about a third of the router's CPU). After
/// the first visible text has been forwarded (never held: TTFT), a relay
/// that has output and finds D's body empty yields to the runtime, which
/// lets D's connection task hand over the next chunk it already read; it
/// forwards what it gathered after [`COALESCE_YIELDS`] yields brought
/// nothing new, or once [`COALESCE_MAX_BYTES`] are gathered. A token that
/// arrives alone waits two scheduler passes.
pub struct Relay {
    /// D's body.
    pub inner: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    /// The rewriter.
    pub rewriter: StreamRewriter,
    /// Set when the turn may be stored.
    pub ctx: Option<StoreCtx>,
    /// Request arrival (TTFT).
    pub t0: Instant,
    /// The router.
    pub state: Arc<AppState>,
    /// Counts this stream on D (`policy = "predicted_ttft"`) until dropped.
    _decode_load: DecodeGuard,
    first: bool,
    ended: bool,
    finishing: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The bytes carrying `data: [DONE]`, held back until the turn is
    /// stored: a client sends the next turn as soon as it sees `[DONE]`,
    /// perhaps to another replica, and must find this one stored.
    held: Option<Bytes>,
    /// Output gathered and not yet forwarded (coalescing).
    out: Vec<u8>,
    /// Visible text was forwarded already (until then nothing is held).
    forwarded: bool,
    /// Coalescing yields in a row without new bytes.
    yielded: u8,
    /// D's stream broke after output was gathered: the error follows it.
    broken: Option<std::io::Error>,
}

impl Relay {
    /// A relay of D's `body`; `decode_load` counts the stream on D.
    pub fn new(
        body: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
        ctx: Option<StoreCtx>,
        t0: Instant,
        state: Arc<AppState>,
        decode_load: DecodeGuard,
    ) -> Self {
        Self {
            inner: body,
            rewriter: StreamRewriter::default(),
            ctx,
            t0,
            state,
            _decode_load: decode_load,
            first: true,
            ended: false,
            finishing: None,
            held: None,
            out: Vec::new(),
            forwarded: false,
            yielded: 0,
            broken: None,
        }
    }

    /// The gathered output, taken.
    fn take_out(&mut self) -> Option<Bytes> {
        if self.out.is_empty() {
            return None;
        }
        self.forwarded |= !self.rewriter.summary.text.is_empty();
        self.yielded = 0;
        Some(Bytes::from(std::mem::take(&mut self.out)))
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(f) = this.finishing.as_mut() {
                return match f.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(()) => {
                        this.finishing = None;
                        match this.held.take() {
                            Some(h) => Poll::Ready(Some(Ok(h))),
                            None => Poll::Ready(None),
                        }
                    }
                };
            }
            if this.ended {
                if let Some(o) = this.take_out() {
                    return Poll::Ready(Some(Ok(o)));
                }
                return Poll::Ready(this.broken.take().map(Err));
            }
            match this.inner.as_mut().poll_next(cx) {
                Poll::Pending => {
                    if this.out.is_empty() {
                        return Poll::Pending;
                    }
                    if this.forwarded
                        && this.yielded < COALESCE_YIELDS
                        && this.out.len() < COALESCE_MAX_BYTES
                    {
                        // Let D's connection task hand over what it has read.
                        this.yielded += 1;
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    return Poll::Ready(this.take_out().map(Ok));
                }
                Poll::Ready(Some(Ok(b))) => {
                    if this.first {
                        this.first = false;
                        this.state
                            .metrics
                            .ttft_seconds
                            .observe(this.t0.elapsed().as_secs_f64());
                    }
                    let mut out = this.rewriter.feed(&b);
                    if this.rewriter.summary.done
                        && let Some(ctx) = this.ctx.take()
                    {
                        // `[DONE]`: store the turn first, then forward it
                        // (the bytes before it go now).
                        this.ended = true;
                        out.extend(this.rewriter.finish());
                        let summary = this.rewriter.summary.clone();
                        this.finishing = Some(Box::pin(ctx.finish(summary, true)));
                        this.held = (!out.is_empty()).then(|| Bytes::from(out));
                        if let Some(before) = this.take_out() {
                            return Poll::Ready(Some(Ok(before)));
                        }
                        continue;
                    }
                    this.out.extend_from_slice(&out);
                    this.yielded = 0;
                    if (!this.forwarded || this.out.len() >= COALESCE_MAX_BYTES)
                        && let Some(o) = this.take_out()
                    {
                        return Poll::Ready(Some(Ok(o)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.ctx = None; // broken stream: never stored
                    this.ended = true;
                    // What was gathered before the break goes first.
                    this.broken = Some(std::io::Error::other(e));
                    continue;
                }
                Poll::Ready(None) => {
                    this.ended = true;
                    let tail = this.rewriter.finish();
                    this.out.extend_from_slice(&tail);
                    if let Some(ctx) = this.ctx.take() {
                        let summary = this.rewriter.summary.clone();
                        this.finishing = Some(Box::pin(ctx.finish(summary, true)));
                        this.held = this.take_out();
                        continue;
                    }
                }
            }
        }
    }
}
