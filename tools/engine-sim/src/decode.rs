//! A decode request after its prompt: the full answer or the SSE stream,
//! and the blocks it holds for the next turn.
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tracing::debug;

use crate::api::{Api, CREATED, knob, words};
use crate::config::StreamParams;
use crate::engine::Engine;
use crate::tokenizer::tokenize_with;
use crate::transfer::sleep_us;

/// A decode request's blocks: released on drop unless held for the next turn.
pub(crate) struct BlockGuard {
    pub(crate) engine: Arc<Engine>,
    pub(crate) ids: Vec<u32>,
}

impl BlockGuard {
    /// Grow to cover `num_tokens` tokens and hold for `decoder_kv_blocks_ttl_ms`
    /// ([`Engine::hold`]: returns the params of the next turn, or null).
    /// With real KV, writes the KV of the generated tokens (`all_tokens` =
    /// prompt then generated, positions `n_prompt..num_tokens`).
    async fn extend_and_hold(
        mut self,
        request_id: &str,
        num_tokens: u64,
        all_tokens: &[u32],
        n_prompt: usize,
    ) -> Value {
        let e = self.engine.clone();
        let more = e.blocks_for(num_tokens).saturating_sub(self.ids.len());
        let mut ids = std::mem::take(&mut self.ids);
        ids.extend(e.allocate_blocks(more).await);
        if let Some(kv) = &e.kv {
            kv.write_tokens(&ids, all_tokens, n_prompt, num_tokens as usize);
        }
        e.hold(request_id, ids, num_tokens, e.decoder_ttl(), None)
            .await
    }
}

impl Drop for BlockGuard {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.engine.alloc.lock().release(&self.ids);
        }
    }
}

/// One decode request after its prompt.
pub(crate) struct DecodeJob {
    pub(crate) e: Arc<Engine>,
    pub(crate) api: Api,
    pub(crate) request_id: String,
    pub(crate) tokens: Arc<Vec<u32>>,
    pub(crate) max_tokens: u64,
    pub(crate) finish: String,
    pub(crate) blocks: BlockGuard,
}

impl DecodeJob {
    /// Prompt tokens then the tokens of the generated words; the tokens held
    /// after a normal finish (all but the last generated one).
    pub(crate) fn held_tokens(&self) -> (Vec<u32>, u64) {
        let mut all = self.tokens.to_vec();
        all.extend(tokenize_with(
            self.e.cfg.tokenizer,
            &words(self.max_tokens).join(" "),
        ));
        let held = (all.len() as u64 - 1).max(self.tokens.len() as u64);
        (all, held)
    }
}

pub(crate) async fn decode_full(job: DecodeJob, body: &Value) -> Response {
    let (all_tokens, held) = job.held_tokens();
    let DecodeJob {
        e,
        api,
        request_id,
        tokens,
        max_tokens,
        finish,
        blocks,
    } = job;
    let n_prompt = tokens.len() as u64;
    e.metrics.generation_tokens.inc_by(max_tokens);
    sleep_us(e.decode_us(max_tokens)).await;
    let text = words(max_tokens).join(" ");
    let normal = finish == "stop" || finish == "length";
    let kv = if normal {
        blocks
            .extend_and_hold(&request_id, held, &all_tokens, n_prompt as usize)
            .await
    } else {
        Value::Null
    };
    let choice = match api {
        Api::Completions => {
            json!({"index": 0, "text": format!(" {text}"), "logprobs": null, "finish_reason": finish})
        }
        Api::Chat => {
            let mut msg = json!({"role": "assistant", "content": text});
            if knob(body, "reasoning") {
                msg["reasoning_content"] = json!("thinking");
            }
            if knob(body, "tool_call") {
                msg["tool_calls"] = json!([{"id": "call0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
            }
            json!({"index": 0, "message": msg, "finish_reason": finish})
        }
    };
    let object = api.object(false);
    Json(json!({
        "id": request_id, "object": object, "created": CREATED, "model": e.cfg.model,
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": max_tokens, "total_tokens": n_prompt + max_tokens},
        "kv_transfer_params": kv,
    }))
    .into_response()
}

pub(crate) fn decode_stream(job: DecodeJob, body: Value) -> Response {
    job.e.metrics.generation_tokens.inc_by(job.max_tokens);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, Infallible>>(16);
    let w = SseWriter {
        tx,
        id: job.request_id.clone(),
        object: job.api.object(true),
        model: job.e.cfg.model.clone(),
        api: job.api,
    };
    tokio::spawn(async move {
        // An error here is the client gone: the stream just stops.
        let _ = stream_answer(job, &body, &w).await;
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// The receiving end of a stream was dropped (the client went away).
struct Closed;

/// Writes one streamed answer's SSE events (`data: {json}\n\n`) into the
/// response body's channel.
struct SseWriter {
    tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, Infallible>>,
    id: String,
    object: &'static str,
    model: String,
    api: Api,
}

impl SseWriter {
    /// Sends one event.
    async fn send(&self, v: &Value) -> Result<(), Closed> {
        self.raw(bytes::Bytes::from(format!("data: {v}\n\n"))).await
    }

    async fn raw(&self, b: bytes::Bytes) -> Result<(), Closed> {
        self.tx.send(Ok(b)).await.map_err(|_| Closed)
    }

    /// A chunk object with these `choices`.
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object, "created": CREATED, "model": self.model, "choices": choices})
    }

    /// Sends a chunk of one choice.
    async fn choice(&self, choice: Value) -> Result<(), Closed> {
        self.send(&self.chunk(json!([choice]))).await
    }

    /// Sends a delta (`content`, `reasoning_content`, `tool_calls`; the
    /// completions API carries only `content`, as `text`).
    async fn delta(&self, d: Value) -> Result<(), Closed> {
        let c = match self.api {
            Api::Chat => json!({"index": 0, "delta": d, "finish_reason": null}),
            Api::Completions => {
                json!({"index": 0, "text": d.get("content").cloned().unwrap_or(json!("")), "logprobs": null, "finish_reason": null})
            }
        };
        self.choice(c).await
    }

    /// The choice that carries `finish_reason`.
    fn finish_choice(&self, finish: &str) -> Value {
        match self.api {
            Api::Chat => json!({"index": 0, "delta": {}, "finish_reason": finish}),
            Api::Completions => {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish})
            }
        }
    }
}

/// Chat only: the role chunk, then the reasoning and tool-call deltas the
/// request's knobs ask for.
async fn stream_preamble(body: &Value, w: &SseWriter) -> Result<(), Closed> {
    if w.api != Api::Chat {
        return Ok(());
    }
    w.delta(json!({"role": "assistant", "content": ""})).await?;
    if knob(body, "reasoning") {
        w.delta(json!({"reasoning_content": "thinking"})).await?;
    }
    if knob(body, "tool_call") {
        let tc = json!({"tool_calls": [{"index": 0, "id": "call0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        w.delta(tc).await?;
    }
    Ok(())
}

/// The whole stream: preamble, one delta per word, the finish chunk, D's
/// params (normal finish only) and `[DONE]`.
async fn stream_answer(job: DecodeJob, body: &Value, w: &SseWriter) -> Result<(), Closed> {
    let (all_tokens, held) = job.held_tokens();
    let DecodeJob {
        e,
        api,
        request_id,
        tokens,
        max_tokens,
        finish,
        blocks,
    } = job;
    stream_preamble(body, w).await?;
    for (i, word) in words(max_tokens).into_iter().enumerate() {
        if e.cfg.decode_us_per_token > 0 {
            tokio::time::sleep(Duration::from_micros(e.decode_us(1))).await;
        }
        let piece = if i == 0 && api == Api::Chat {
            word
        } else {
            format!(" {word}")
        };
        w.delta(json!({"content": piece})).await?;
    }
    if knob(body, "truncate_stream") {
        debug!("simulated truncated stream");
        return Ok(());
    }
    // D holds its blocks on a normal finish only (other finishes free them).
    let kv = if finish == "stop" || finish == "length" {
        Some(
            blocks
                .extend_and_hold(&request_id, held, &all_tokens, tokens.len())
                .await,
        )
    } else {
        drop(blocks);
        None
    };
    let mut fin = w.chunk(json!([w.finish_choice(&finish)]));
    let placement = e.cfg.stream_params;
    match (kv, placement) {
        (Some(kv), StreamParams::FinishChunk) => {
            fin["kv_transfer_params"] = kv;
            w.send(&fin).await?;
        }
        (Some(kv), StreamParams::OwnChunk) => {
            w.send(&fin).await?;
            let mut v = w.chunk(json!([]));
            v["kv_transfer_params"] = kv;
            w.send(&v).await?;
        }
        (_, _) => w.send(&fin).await?,
    }
    w.raw(bytes::Bytes::from_static(b"data: [DONE]\n\n")).await
}
