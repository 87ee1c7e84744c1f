"""OpenAI-compatible client for the real-vLLM tests: multi-turn conversations,
streaming or not, with greedy tokens and logprobs per turn (stdlib only)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field

MODEL = "tiny"
#: Requests retried after a 503 "no healthy ... engine" from the router.
RETRIES_503: list[str] = []
#: Stream chunks with neither `choices[0]` nor `usage` (what crashes OpenAI
#: clients that read `choices[0]` of every chunk): (path, chunk).
BARE_CHUNKS: list = []
TOP = 5


@dataclass
class Turn:
    """One answered turn: generated tokens with their logprobs and the top-5
    alternatives ({token: logprob}) per position."""

    text: str
    tokens: list[str]
    logprobs: list[float]
    top: list[dict[str, float]]
    finish_reason: str | None
    has_params: bool
    status: int = 200
    raw: dict | None = field(default=None, repr=False)


def post(base: str, path: str, body: dict, stream: bool, timeout: float = 300.0) -> tuple[int, list[dict]]:
    """POST `body`; returns (status, [json bodies]): one for a plain answer,
    one per `data:` event for a stream."""
    u = urllib.parse.urlparse(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        raw = r.read().decode()
    finally:
        c.close()
    if r.status != 200:
        return r.status, [{"error": raw}]
    if not stream:
        return r.status, [json.loads(raw)]
    events = []
    for line in raw.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return r.status, events


def ask(base: str, kind: str, stream: bool, history, conv_id: str | None, max_tokens: int) -> Turn:
    """One request. `history`: chat messages (kind "chat") or the prompt text
    (kind "completions")."""
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if conv_id is not None:
        body["conversation_id"] = conv_id
    if kind == "chat":
        body.update(messages=history, logprobs=True, top_logprobs=TOP)
        path = "/v1/chat/completions"
    else:
        body.update(prompt=history, logprobs=TOP)
        path = "/v1/completions"
    st, bodies = post(base, path, body, stream)
    for _ in range(3):
        # kvloop-router marks an engine unhealthy after one slow /health
        # (a busy CPU engine on a loaded machine) and answers 503 until the
        # next good check: retry a bounded number of times, and count it.
        if st != 503 or "no healthy" not in json.dumps(bodies):
            break
        RETRIES_503.append(path)
        time.sleep(3)
        st, bodies = post(base, path, body, stream)
    if st != 200:
        return Turn("", [], [], [], None, False, st, bodies[0])
    text, toks, lps, top, fin, params = "", [], [], [], None, False
    for b in bodies:
        params = params or bool(b.get("kv_transfer_params"))
        if stream and not (b.get("choices") or b.get("usage")):
            BARE_CHUNKS.append((path, b))
        for ch in b.get("choices") or []:
            fin = ch.get("finish_reason") or fin
            lp = ch.get("logprobs") or {}
            if kind == "chat":
                text += (ch.get("message") or ch.get("delta") or {}).get("content") or ""
                for e in lp.get("content") or []:
                    toks.append(e["token"])
                    lps.append(e["logprob"])
                    top.append({t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
            else:
                text += ch.get("text") or ""
                toks += lp.get("tokens") or []
                lps += lp.get("token_logprobs") or []
                top += [dict(t) for t in lp.get("top_logprobs") or []]
    return Turn(text, toks, lps, top, fin, params, st, bodies[-1] if bodies else None)


def conversation(base: str, kind: str, stream: bool, users: list[str], conv_id: str | None,
                 max_tokens: int = 12) -> list[Turn]:
    """Runs len(users) turns; each turn's history is the previous one plus
    the answer plus the next user text."""
    turns: list[Turn] = []
    msgs: list[dict] = []
    prompt = ""
    for u in users:
        if kind == "chat":
            msgs.append({"role": "user", "content": u})
            t = ask(base, kind, stream, list(msgs), conv_id, max_tokens)
            msgs.append({"role": "assistant", "content": t.text})
        else:
            prompt += f"USER : {u} END ASSISTANT :"
            t = ask(base, kind, stream, prompt, conv_id, max_tokens)
            prompt += t.text + " END "
        turns.append(t)
    return turns


def max_logprob_diff(a: Turn, b: Turn) -> float:
    """Largest |logprob difference| between two answers, over the chosen
    tokens and every top-5 alternative present in both; inf when the tokens
    differ (then the answers are not the same)."""
    if a.tokens != b.tokens or not a.tokens:
        return float("inf")
    d = 0.0
    for x, y in zip(a.logprobs, b.logprobs):
        d = max(d, abs(x - y))
    for ta, tb in zip(a.top, b.top):
        for k in ta.keys() & tb.keys():
            d = max(d, abs(ta[k] - tb[k]))
    return d


def context_divergence(a: Turn, b: Turn) -> float:
    """How far two contexts' answers are apart: inf when the greedy tokens
    differ (every turn check compares tokens exactly, so such a READ of wrong
    blocks is caught outright), else the largest |logprob difference| over
    every generated position's top-5 (a token missing from one side counts at
    that side's smallest listed logprob)."""
    if not a.top or not b.top or a.tokens != b.tokens:
        return float("inf")
    d = 0.0
    for ta, tb in zip(a.top, b.top):
        fa, fb = min(ta.values()), min(tb.values())
        d = max(d, max(abs(ta.get(k, fa) - tb.get(k, fb)) for k in ta.keys() | tb.keys()))
    return d