"""The P/D router: an OpenAI-compatible front that sends each request to a prefill and a
decode instance at once, paired by a transfer id.

    pdhal-vllm-router --port 8000 \\
        --prefill http://127.0.0.1:8100=127.0.0.1:47100 --decode http://127.0.0.1:8200

`--prefill URL=MESSAGER` (the instance's messager, HOST:PORT) and `--decode URL` may each be
given several times. `/v1/completions` and `/v1/chat/completions`, streamed or not: the
prefill instance gets the request with `max_tokens: 1` and `do_remote_decode`, the decode
instance the client's request with `do_remote_prefill` and the prefill's messager, and the
client gets the decode instance's answer as it comes. Each request goes to the healthy
instance of each kind with the fewest requests in flight (the earliest listed on a tie).

When the prefill instance fails (an HTTP error, a dropped connection, `--timeout`), the
decode request is cancelled before it answers, and `--on-prefill-failure` says what the
client gets: `error` (HTTP 502 naming the instance and the reason) or `recompute` (the
client's request again, on a decode instance, without transfer params: it prefills
itself). While no prefill instance is healthy, every request meets that policy at once
(recompute: the decode instances serve alone). An instance that fails a request or its
health check (`GET /health`, every `--health-interval` s, answered within
`--health-timeout` s) gets no new request until it passes one again. A client that hangs
up has both instances abort its request at once (closing their connections), so each
frees its KV now. A decode instance's own error (a failed KV load under
kv_load_failure_policy "fail") goes to the client as is. A decode request that fails (an
error status, a dropped connection, `--timeout`) has the router tell the prefill's
messager (`--auth-key`, default $PDHAL_VLLM_KEY: the deployment's key) that its decode
side will never claim the transfer: a prefill that had ended frees its blocks then, not at
the messager's `--claim-timeout`.
`GET /health` answers 200 while every pool has a healthy instance (503 otherwise), with
each instance's state.

`--sequential` sends the decode request only once the prefill instance answered, for
connectors whose decode side must find the whole KV there when it first looks (vLLM's
ExampleConnector: a decode scheduled mid-prefill finds the prompt's folder but not every
layer's file); pdhal's decode side waits for the layers itself, so it does not need it.

`--kv-transfer-params prefill` fronts any vLLM connector the way vLLM's own P/D proxy does:
the prefill instance gets `{"do_remote_decode": true}`, and the decode instance, once the
prefill answered, the `kv_transfer_params` that answer carries (NixlConnector's engine id,
host, port and block ids; pdhal's transfer id and messager); a prefill answer without them
is a prefill failure. `--prefill URL` then needs no messager. The default, `pdhal`, makes
them here (a transfer id, the prefill's messager) and sends both requests at once, so
pdhal's decode side takes each layer as it lands.
`--trace FILE` appends a JSON line per request step (CLOCK_MONOTONIC ns `t`, the transfer
id `tid`): "received" (the request's body read), "forwarded" (prefill request sent; the
decode request too unless sequential), "prefilled" (the prefill instance answered),
"first" (the decode instance's first bytes), "done" (relayed to the end), "abandoned" (the
prefill's messager was told, `told` true, or could not be, of a failed decode).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from pdhal import PdhalError, transfer
from pdhal_vllm.wire import KEY_VAR, ConnectorError, Tracer, auth_key

log = logging.getLogger("pdhal_vllm.router")
#: Seconds to tell a prefill instance's messager that a request's decode failed.
ABANDON_S = 5.0
#: Abandons told at once, and waiting, at most: a messager that does not answer holds a
#: thread each for ABANDON_S, never the router's own (its lookups, its health checks).
ABANDON_THREADS, MOST_ABANDONS = 4, 1024

ROUTES = ("/v1/completions", "/v1/chat/completions")
POLICIES = ("error", "recompute")
#: Where a decode request's kv_transfer_params come from (see the module docstring).
PARAMS = ("pdhal", "prefill")


class RouterError(RuntimeError):
    """An instance failed a request: its HTTP status (502 when it gave none) and why."""

    def __init__(self, status: int, why: str):
        super().__init__(why)
        self.status = status


@dataclass
class Instance:
    """One vLLM server behind the router."""

    url: str
    messager: str | None = None  # a prefill instance's cache messager, HOST:PORT
    in_flight: int = 0
    healthy: bool = True
    why: str = ""  # the last failure, while unhealthy

    def failed(self, why: str) -> None:
        if self.healthy:
            log.warning(
                "%s failed: %s; no new requests until its health check passes", self.url, why
            )
        self.healthy, self.why = False, why

    def state(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "why": self.why,
        }


def _instance(text: str, kind: str) -> Instance:
    url, _, messager = text.partition("=")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"a {kind} instance is http(s)://HOST:PORT, got {url!r}")
    if kind == "decode" and messager:
        raise argparse.ArgumentTypeError(f"a decode instance is a URL, got {text!r}")
    return Instance(url.rstrip("/"), messager or None)


class Router:
    """Pairs each request's prefill and decode (see the module docstring)."""

    def __init__(
        self,
        prefills: list[Instance],
        decodes: list[Instance],
        *,
        on_prefill_failure: str = "error",
        timeout: float = 300.0,
        health_interval: float = 2.0,
        health_timeout: float = 5.0,
        sequential: bool = False,
        kv_transfer_params: str = "pdhal",
        trace: str | None = None,
        key: bytes | None = None,
    ):
        if not prefills or not decodes:
            raise ValueError("the router needs at least one prefill and one decode instance")
        if on_prefill_failure not in POLICIES:
            raise ValueError(
                f"on_prefill_failure must be one of {POLICIES}, got {on_prefill_failure!r}"
            )
        if kv_transfer_params not in PARAMS:
            raise ValueError(
                f"kv_transfer_params must be one of {PARAMS}, got {kv_transfer_params!r}"
            )
        unnamed = [i.url for i in prefills if i.messager is None]
        if kv_transfer_params == "pdhal" and unnamed:
            raise ValueError(
                f"a prefill instance is URL=MESSAGER (its messager's HOST:PORT) unless the "
                f"kv_transfer_params come from the prefill's answer; none for {unnamed[0]}"
            )
        self.params = kv_transfer_params
        self.prefills, self.decodes = prefills, decodes
        self.policy, self.timeout, self.health_interval = (
            on_prefill_failure,
            timeout,
            health_interval,
        )
        self.health_timeout = health_timeout
        self.sequential = sequential or kv_transfer_params == "prefill"
        self.trace = Tracer(trace)
        self.key = key
        self._telling: set[asyncio.Future] = set()  # abandons on their way
        # messagers that could not be told last time, with how many since: warned about once
        # per outage, not once per request
        self._untold: dict[str, int] = {}
        self._untold_lock = threading.Lock()
        self._abandons = ThreadPoolExecutor(ABANDON_THREADS, "pdhal-router-abandon")
        self._session: ClientSession | None = None
        self._health: asyncio.Task | None = None

    # ---- the app --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        for route in ROUTES:
            app.router.add_post(route, self._handle)
        app.router.add_get("/health", self._health_page)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        # A new connection per request: a request sent on a kept-alive connection to a
        # vLLM server (uvicorn) right after its last answer was seen to sit unserved until
        # the connection closed (60-120 s here, under load; a race like the one uvicorn's
        # issue 748 describes, the last request's disconnect watch taking the next one's
        # body), so none is kept.
        self._session = ClientSession(
            timeout=ClientTimeout(total=self.timeout), connector=TCPConnector(force_close=True)
        )
        self._health = asyncio.create_task(self._check_health())

    async def _stop(self, _app) -> None:
        self._health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._health
        await self._session.close()
        self._abandons.shutdown(wait=False, cancel_futures=True)

    async def _health_page(self, _request) -> web.Response:
        pools = {"prefill": self.prefills, "decode": self.decodes}
        ok = all(any(i.healthy for i in pool) for pool in pools.values())
        body = {kind: [i.state() for i in pool] for kind, pool in pools.items()}
        return web.json_response(body, status=200 if ok else 503)

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check(i) for i in self.prefills + self.decodes))
            await asyncio.sleep(self.health_interval)

    async def _check(self, instance: Instance) -> None:
        """One health check. A dead instance refuses it at once; a busy one (a long step on
        a loaded host) may take seconds to answer, and is not failed for that before
        `health_timeout` (it was, at the interval: a prefill instance busy for a second had
        every request recomputed meanwhile)."""
        try:
            async with self._session.get(
                f"{instance.url}/health", timeout=ClientTimeout(total=self.health_timeout)
            ) as answer:
                if answer.status == 200:
                    instance.healthy, instance.why = True, ""
                else:
                    instance.failed(f"its health check answered {answer.status}")
        except (ClientError, asyncio.TimeoutError) as e:
            instance.failed(f"its health check failed: {type(e).__name__}: {e}")

    # ---- one request ----------------------------------------------------------------

    @staticmethod
    def _pick(pool: list[Instance], kind: str) -> Instance:
        healthy = [i for i in pool if i.healthy]
        if not healthy:
            raise RouterError(
                503, f"no healthy {kind} instance: " + "; ".join(f"{i.url}: {i.why}" for i in pool)
            )
        return min(healthy, key=lambda i: i.in_flight)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        received = time.monotonic_ns()
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            decode = self._pick(self.decodes, "decode")
        except RouterError as e:
            return _error(e.status, str(e))
        try:
            prefill = self._pick(self.prefills, "prefill")
        except RouterError as e:  # every prefill instance down: the policy decides
            return await self._prefill_failed(request, body, str(e), e.status)
        tid = f"pdhal-{uuid.uuid4().hex}"  # (the trace's name of the request, either way)
        to_prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        to_prefill["max_tokens"] = 1
        if "max_completion_tokens" in to_prefill:
            to_prefill["max_completion_tokens"] = 1
        if self.params == "pdhal":
            to_prefill["kv_transfer_params"] = {"do_remote_decode": True, "pdhal_transfer_id": tid}
            to_decode = body | {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "pdhal_transfer_id": tid,
                    "pdhal_messager": prefill.messager,
                }
            }
        else:  # the prefill's answer gives them (_pair)
            to_prefill["kv_transfer_params"] = {"do_remote_decode": True}
            to_decode = body
        self.trace("received", tid=tid, t=received)
        self.trace("forwarded", tid=tid)
        prefilled = asyncio.create_task(self._prefill(prefill, request.path, to_prefill, tid))
        try:
            return await self._pair(request, body, prefill, decode, prefilled, to_decode, tid)
        except asyncio.CancelledError:  # the client hung up: the prefill instance aborts too
            prefilled.cancel()
            raise

    async def _pair(self, request, body, prefill, decode, prefilled, to_decode, tid):
        """The decode side of a request whose prefill runs as `prefilled`: the client's
        answer, or what the failure policy gives."""
        if self.sequential:  # the decode once the prefill answered
            with contextlib.suppress(RouterError):
                await prefilled
            if prefilled.exception() is not None:
                return await self._prefill_failed(request, body, *_failure(prefill, prefilled))
            if self.params == "prefill":
                params = prefilled.result()
                if not isinstance(params, dict):
                    why = (
                        f"prefill instance {prefill.url} answered without kv_transfer_params "
                        f"(is its connector's kv_role kv_producer?)"
                    )
                    return await self._prefill_failed(request, body, why, 502)
                to_decode = body | {"kv_transfer_params": params}
        decoding = asyncio.create_task(self._first_bytes(decode, request.path, to_decode))
        try:
            await asyncio.wait([prefilled, decoding], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # (wait does not cancel what it waits for)
            _discard(decoding, decode)
            raise
        if not decoding.done() and prefilled.exception() is not None:
            await _cancel(decoding)  # the client has no byte yet: the policy decides
            _discard(decoding, decode)  # (in case it answered meanwhile)
            return await self._prefill_failed(request, body, *_failure(prefill, prefilled))
        try:
            answer, first = await decoding
        except RouterError as e:
            await _cancel(prefilled)  # aborted, the prefill instance fails its transfer
            self._abandon(prefill, tid, f"decode instance {decode.url}: {e}")
            return _error(e.status, f"decode instance {decode.url}: {e}")
        # the answer is this handler's now: _relay releases it, with nothing awaited before
        self.trace("first", tid=tid, status=answer.status)
        if answer.status != 200:
            prefilled.cancel()
            self._abandon(prefill, tid, f"decode instance {decode.url} answered {answer.status}")
        try:
            return await self._relay(request, answer, first, decode)
        finally:
            self.trace("done", tid=tid)
            with contextlib.suppress(RouterError, asyncio.CancelledError):
                await prefilled  # done by now: the first token needed its KV

    def _abandon(self, prefill: Instance, tid: str, why: str) -> None:
        """Tell `prefill`'s messager that `tid`'s decode side will never claim it (its decode
        request failed), on a thread of its own: a prefill that ended before the failure
        frees its blocks now instead of at its claim lease (one still running was aborted
        with its request). Needs the deployment's key; without it the lease frees them."""
        if self.key is None or self.params != "pdhal":
            return
        if len(self._telling) >= MOST_ABANDONS:
            log.warning(
                "%d abandons are waiting to be told: %s's is not; its claim timeout frees "
                "the prefill's blocks",
                len(self._telling),
                tid,
            )
            return
        told = asyncio.get_running_loop().run_in_executor(
            self._abandons, self._tell, prefill.messager, tid, why
        )
        self._telling.add(told)
        told.add_done_callback(self._telling.discard)

    def _tell(self, messager: str, tid: str, why: str) -> None:
        """One abandon, on an abandon thread. A messager that cannot be told is warned
        about once, until it is told again (then the count of those it missed is logged)."""
        try:
            transfer.abandon(messager, tid, why, key=self.key, timeout=ABANDON_S)
        except PdhalError as e:
            with self._untold_lock:
                first = messager not in self._untold
                self._untold[messager] = self._untold.get(messager, 0) + 1
            if first:
                log.warning(
                    "could not tell the messager at %s that %s's decode failed (%s): its "
                    "claim timeout frees the prefill's blocks (said once until it is told "
                    "again)",
                    messager,
                    tid,
                    e,
                )
            self.trace("abandoned", tid=tid, told=False)  # after the log: a test reads both
            return
        with self._untold_lock:
            missed = self._untold.pop(messager, 0)
        if missed:
            log.warning(
                "told the messager at %s again; %d abandons could not be told meanwhile "
                "(their claim timeouts free those blocks)",
                messager,
                missed,
            )
        self.trace("abandoned", tid=tid, told=True)

    async def _prefill(self, prefill: Instance, path: str, body: dict, tid: str):
        """The prefill request: with --kv-transfer-params prefill, the kv_transfer_params
        its answer carries (None if none); else None, its answer unread."""
        prefill.in_flight += 1
        try:
            async with self._session.post(prefill.url + path, json=body) as answer:
                text = await answer.text()
                self.trace("prefilled", tid=tid, status=answer.status)
                if answer.status != 200:
                    raise RouterError(answer.status, f"answered {answer.status}: {text[:300]}")
            if self.params != "prefill":
                return None
            try:
                said = json.loads(text)
            except ValueError:
                raise RouterError(502, f"answered what is not JSON: {text[:300]}") from None
            return said.get("kv_transfer_params") if isinstance(said, dict) else None
        except (ClientError, asyncio.TimeoutError) as e:
            prefill.failed(f"{type(e).__name__}: {e}")
            raise RouterError(502, f"{type(e).__name__}: {e}") from None
        finally:
            prefill.in_flight -= 1

    async def _first_bytes(self, decode: Instance, path: str, body: dict):
        """The decode instance's response and the first bytes of its body (a first token
        comes only once its KV landed). It counts as in flight until _relay is done."""
        decode.in_flight += 1
        answer = None
        try:
            answer = await self._session.post(decode.url + path, json=body)
            return answer, await answer.content.readany()
        except BaseException as e:  # cancelled: closing the connection aborts vLLM's request
            if answer is not None:
                answer.close()
            decode.in_flight -= 1
            if isinstance(e, (ClientError, asyncio.TimeoutError)):
                decode.failed(f"{type(e).__name__}: {e}")
                raise RouterError(502, f"{type(e).__name__}: {e}") from None
            raise

    async def _relay(self, request, answer, first: bytes, decode: Instance) -> web.StreamResponse:
        """The decode instance's answer to the client, chunk by chunk as it comes."""
        try:
            out = web.StreamResponse(status=answer.status)
            out.content_type = answer.content_type
            await out.prepare(request)
            await out.write(first)
            async for chunk in answer.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
        except (ClientError, asyncio.TimeoutError) as e:
            decode.failed(f"{type(e).__name__}: {e}")
            raise  # the client's connection is cut: its answer is incomplete, never wrong
        finally:
            answer.release()
            decode.in_flight -= 1

    async def _prefill_failed(self, request, body: dict, why: str, status: int):
        if self.policy == "error":
            return _error(status, why)
        log.warning("%s; recomputing on a decode instance", why)
        try:
            decode = self._pick(self.decodes, "decode")
            answer, first = await self._first_bytes(decode, request.path, body)
        except RouterError as e:
            return _error(e.status, f"{why}; and the recompute failed: {e}")
        return await self._relay(request, answer, first, decode)


def _failure(prefill: Instance, prefilled: asyncio.Task) -> tuple[str, int]:
    """Why the prefill request failed, and the HTTP status to answer with."""
    error = prefilled.exception()
    return f"prefill instance {prefill.url}: {error}", getattr(error, "status", 502)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "pdhal_router_error", "code": status}},
        status=status,
    )


async def _cancel(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it ended; the caller's own cancellation (its client
    hung up meanwhile) passes through."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # (retrieved: a failure it had is not this caller's)


def _discard(decoding: asyncio.Task, decode: Instance) -> None:
    """A decode request whose answer nobody will relay: cancelled (its connection closes,
    vLLM aborts it), or, when it already answered, that answer closed and counted out."""
    if not decoding.done():
        decoding.cancel()
    elif not decoding.cancelled() and decoding.exception() is None:
        answer, _ = decoding.result()
        answer.close()
        decode.in_flight -= 1


async def _serve(router: Router, host: str, port: int) -> None:
    """Serve until cancelled (SIGINT, SIGTERM); print the address once listening (port 0:
    any free port)."""
    # a client that hangs up cancels its handler: its instances abort the request and
    # free its KV at once, not when an answer finds no one to take it
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"pdhal-vllm router listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pdhal-vllm-router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL[=MESSAGER]",
        type=lambda t: _instance(t, "prefill"),
        help="a prefill instance and its messager (none with --kv-transfer-params prefill)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        type=lambda t: _instance(t, "decode"),
        help="a decode instance",
    )
    parser.add_argument("--on-prefill-failure", choices=POLICIES, default="error")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--health-interval", type=float, default=2.0)
    parser.add_argument(
        "--health-timeout",
        type=float,
        default=5.0,
        help="seconds an instance has to answer a health check (a dead one refuses at once)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="send the decode request only once the prefill answered (vLLM's ExampleConnector)",
    )
    parser.add_argument(
        "--kv-transfer-params",
        choices=PARAMS,
        default="pdhal",
        help="made here for pdhal (both requests at once), or passed on from the prefill's "
        "answer to the decode (vLLM's proxy pattern: any connector, NixlConnector included)",
    )
    parser.add_argument(
        "--trace", default=None, help="append a JSON line per request step to this file"
    )
    parser.add_argument(
        "--auth-key",
        default=None,
        help=f"hex key of the messagers' sessions (default: ${KEY_VAR}); with it, a request "
        "whose decode failed is abandoned at its prefill's messager, which frees its blocks "
        "at once instead of at its claim timeout",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    try:
        router = Router(
            args.prefill,
            args.decode,
            on_prefill_failure=args.on_prefill_failure,
            timeout=args.timeout,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            sequential=args.sequential,
            kv_transfer_params=args.kv_transfer_params,
            trace=args.trace,
            key=auth_key(args.auth_key) if args.auth_key or os.environ.get(KEY_VAR) else None,
        )
    except (ValueError, ConnectorError) as e:
        parser.error(str(e))
    asyncio.run(_serve(router, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
