"""Unit tests of kvloop_vllm.sse and of the wrapper, without vLLM."""

import asyncio
import json
import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from kvloop_vllm import _wrap  # noqa: E402
from kvloop_vllm.sse import add_params, is_terminal  # noqa: E402


def ev(body):
    return "data: " + json.dumps(body) + "\n\n"


def test_terminal_detection():
    assert not is_terminal(ev({"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}))
    assert is_terminal(ev({"choices": [{"delta": {}, "finish_reason": "length"}]}))
    assert not is_terminal("data: [DONE]\n\n")
    assert not is_terminal(ev({"choices": [], "usage": {"prompt_tokens": 1}}))
    assert not is_terminal("data: {not json finish_reason\n\n")


def test_add_params_keeps_everything_else():
    body = {"id": "x", "choices": [{"text": "b", "finish_reason": "stop", "logprobs": {"t": [-1.5]}}]}
    p = {"remote_engine_id": "d0", "remote_block_ids": [[1, 2]], "dcp_size": 1}
    out = json.loads(add_params(ev(body), p)[len("data: "):])
    assert out.pop("kv_transfer_params") == p
    assert out == body
    # never overwrites
    body["kv_transfer_params"] = {"a": 1}
    assert add_params(ev(body), p) == ev(body)


class Res:
    def __init__(self, params):
        self.kv_transfer_params = params


class Serving:
    async def stream(self, request, result_generator, request_id):
        async for item in result_generator:
            res = item[1]
            fin = "stop" if res.kv_transfer_params is not None else None
            yield ev({"choices": [{"text": "t", "finish_reason": fin}]})
        yield "data: [DONE]\n\n"


def run(gen):
    async def collect():
        return [e async for e in gen]

    return asyncio.run(collect())


def test_wrapper_puts_params_on_the_final_chunk_only():
    async def results():
        yield (0, Res(None))
        yield (0, Res(None))
        yield (0, Res({"remote_engine_id": "d0"}))

    wrapped = _wrap(Serving.stream)
    events = run(wrapped(Serving(), "req", results(), request_id="r1"))
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert [("kv_transfer_params" in b) for b in bodies] == [False, False, True]
    assert bodies[-1]["kv_transfer_params"] == {"remote_engine_id": "d0"}
    assert events[-1] == "data: [DONE]\n\n"


def test_wrapper_without_params_changes_nothing():
    async def results():
        yield (0, Res(None))

    events = run(_wrap(Serving.stream)(Serving(), "req", result_generator=results(), request_id="r"))
    assert all("kv_transfer_params" not in e for e in events)
