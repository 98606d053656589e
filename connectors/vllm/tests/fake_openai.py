"""A stand-in OpenAI server for the router's tests: `python fake_openai.py NAME MODE LOG [PORT]`.

It answers /v1/completions and /v1/chat/completions (JSON, or server-sent events when the
request streams) with text naming itself, and /health with 200. As a vLLM instance of a P/D
connector would, a prefill request (do_remote_decode) notes its transfer id (pdhal's, or one
of its own) as prefilled and answers with the kv_transfer_params its decode side needs (as
NixlConnector does: its engine and request), and a decode request (do_remote_prefill)
answers only once its transfer id was noted (its KV landed). It appends each request's body,
each prefill, and each request a client gave up on, to LOG as JSON lines. MODE: "ok"; "fail"
(500 to every completion); "slow" (each completion waits 30 s first, so it stays in flight);
"slowhealth" (/health answers after 1 s, as a busy vLLM server's may); "noparams" (a prefill
answers without kv_transfer_params, as an instance with no producer connector). It prints
its port once listening (port 0: any free one)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys

from aiohttp import web

NAME, MODE, LOG = sys.argv[1], sys.argv[2], sys.argv[3]
PORT = int(sys.argv[4]) if len(sys.argv) > 4 else 0
SERIAL = itertools.count()


def note(**entry) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps(entry | {"server": NAME}) + "\n")


async def completion(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    note(event="request", path=request.path, body=body)
    if MODE == "fail":
        return web.json_response({"error": {"message": f"{NAME} fails"}}, status=500)
    params = body.get("kv_transfer_params") or {}
    try:
        if MODE == "slow":
            await asyncio.sleep(30)
        if params.get("do_remote_prefill"):
            await prefilled(params.get("pdhal_transfer_id") or params["remote_request_id"])
        answer = {"choices": [{"text": f"from {NAME}"}], "server": NAME}
        if params.get("do_remote_decode") and MODE != "noparams":
            tid = params.get("pdhal_transfer_id") or f"{NAME}-{next(SERIAL)}"
            note(event="prefilled", tid=tid)
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "remote_engine_id": NAME,
                "remote_request_id": tid,
            }
        if not body.get("stream"):
            return web.json_response(answer)
        text = answer["choices"][0]["text"]
        out = web.StreamResponse()
        out.content_type = "text/event-stream"
        await out.prepare(request)
        for word in text.split():
            await out.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
    except asyncio.CancelledError:  # the client closed its connection
        note(event="cancelled", path=request.path, body=body)
        raise


async def prefilled(tid: str, bound: float = 30.0) -> None:
    """Until a prefill noted `tid` in LOG."""
    for _ in range(int(bound / 0.01)):
        with open(LOG) as f:
            if any(json.loads(line).get("tid") == tid for line in f):
                return
        await asyncio.sleep(0.01)


async def health(_request) -> web.Response:
    if MODE == "slowhealth":
        await asyncio.sleep(1.0)
    return web.Response(text="ok")


async def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", PORT)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


asyncio.run(main())
