"""Pure helpers: add `kv_transfer_params` to the terminal chunk of a vLLM
OpenAI-compatible SSE stream. No vLLM import; unit-tested in tests/.

A terminal chunk is a `data: {...}` event whose `choices` carry a non-null
`finish_reason` (vLLM sends exactly one per choice). PR #40186 puts D's
params on that chunk as a top-level `kv_transfer_params` key, as the
non-streaming response has them.
"""

from __future__ import annotations

import json
from typing import Any

_PREFIX = "data: "


def is_terminal(event: str) -> bool:
    """Whether `event` (one SSE event, `data: <json>\\n\\n`) is a chunk with a
    non-null finish_reason. Cheap string test first: most chunks are not."""
    if not event.startswith(_PREFIX) or '"finish_reason"' not in event:
        return False
    body = _load(event)
    if body is None:
        return False
    choices = body.get("choices") or []
    return any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)


def add_params(event: str, params: dict[str, Any]) -> str:
    """`event` with `kv_transfer_params` set to `params` at the top level of
    its JSON body; unchanged when it is not a JSON `data:` event or already
    has the key."""
    body = _load(event)
    if body is None or "kv_transfer_params" in body:
        return event
    body["kv_transfer_params"] = params
    return _PREFIX + json.dumps(body, separators=(",", ":")) + "\n\n"


def _load(event: str) -> dict[str, Any] | None:
    if not event.startswith(_PREFIX):
        return None
    payload = event[len(_PREFIX):].strip()
    if not payload or payload == "[DONE]":
        return None
    try:
        body = json.loads(payload)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None
