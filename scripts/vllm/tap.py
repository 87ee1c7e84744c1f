"""A recording HTTP proxy in front of one vLLM engine, for `make test-vllm`.

    python scripts/vllm/tap.py --listen 127.0.0.1:18100 --upstream http://10.86.76.2:8100 --log FILE

Forwards every request unchanged (method, path, headers but Host, body) and
streams the answer back unchanged, chunk by chunk. For each POST it appends
one JSON line to FILE: {"t": unix s, "path", "request": <JSON body>,
"status", "response": <JSON body> | null, "sse": [<JSON data events>] | null}.
The harness reads it to compare what D returned with what P received (the
kv_transfer_params the router passed through). GETs (health, metrics) are
forwarded, not logged. Prints "READY" on stdout when listening.

Idle connections to the engine are kept at most 2 s: vLLM's server
(uvicorn) closes a keep-alive connection after 5 s idle (its
`timeout_keep_alive` default), and reusing one it is closing resets the
request. A request whose connection fails before the answer's headers
arrived (such a stale connection: the engine never read it) is sent once
more, logged on stderr; a second failure answers 502 naming the error, as
does a refused connection (the engine is starting or restarting), at once.
"""

import argparse
import asyncio
import json
import sys
import time

import aiohttp
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--log", required=True)
    a = ap.parse_args()
    host, port = a.listen.rsplit(":", 1)
    logf = open(a.log, "a", buffering=1)

    async def handle(req: web.Request) -> web.StreamResponse:
        body = await req.read()
        headers = {k: v for k, v in req.headers.items() if k.lower() not in HOP}
        sess: aiohttp.ClientSession = req.app["sess"]
        for attempt in (1, 2):
            try:
                up = await sess.request(req.method, a.upstream + req.path_qs, data=body, headers=headers)
                break
            except aiohttp.ClientConnectorError as e:
                # Nothing listening (the engine is starting or restarting).
                return web.Response(status=502, text=f"tap: engine unreachable: {e!r}")
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
                if attempt == 2:
                    return web.Response(status=502, text=f"tap: engine connection failed twice: {e!r}")
                print(f"tap: {req.method} {req.path} resent after {e!r}",
                      file=sys.stderr, flush=True)
        async with up:
            out = web.StreamResponse(status=up.status)
            for k, v in up.headers.items():
                if k.lower() not in HOP and k.lower() != "content-encoding":
                    out.headers[k] = v
            await out.prepare(req)
            raw = bytearray()
            async for chunk in up.content.iter_any():
                raw += chunk
                await out.write(chunk)
            await out.write_eof()
        if req.method == "POST":
            rec = {"t": time.time(), "path": req.path, "status": up.status,
                   "request": _json(body), "response": None, "sse": None}
            if "text/event-stream" in up.headers.get("content-type", ""):
                rec["sse"] = [_json(line[5:].strip().encode())
                              for line in raw.decode(errors="replace").splitlines()
                              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
            else:
                rec["response"] = _json(bytes(raw))
            logf.write(json.dumps(rec) + "\n")
        return out

    async def start():
        app = web.Application(client_max_size=256 * 1024 * 1024)
        conn = aiohttp.TCPConnector(keepalive_timeout=2)
        app["sess"] = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600),
                                            auto_decompress=False)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, int(port)).start()
        print("READY", flush=True)
        await asyncio.Event().wait()

    asyncio.run(start())


def _json(b: bytes):
    try:
        return json.loads(b)
    except ValueError:
        return None


if __name__ == "__main__":
    main()
