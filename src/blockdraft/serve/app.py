"""An OpenAI-compatible HTTP server (Starlette + uvicorn) over the batched speculative engine.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with `stream: true` as server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`), GET /v1/models, GET /health (status and live metrics), GET /metrics
(Prometheus, see serve/metrics.py). Request validation (the OpenAI schema, error bodies) lives in serve/schema.py.

Honoured parameters: model (must be the served one), messages / prompt, max_tokens (chat: also
max_completion_tokens), temperature, top_p, top_k (extension), seed, stop (string or list of up to 4), n=1,
stream, stream_options.include_usage, ignore_eos (extension), user. Parameters the server cannot honour (n>1,
logprobs, tools, penalties, logit_bias, response_format other than text, ...) are refused with an OpenAI-style
error object and status 400 when set to anything but their neutral value; unknown parameters are refused too.

Every response carries `usage` and a `blockdraft` object with the acceptance figures (tau = mean tokens committed
per target forward, target_forwards, accept_lengths, draft name, timings).

Limits: binds 127.0.0.1 by default; optional API key (401); request body limit (413); prompt longer than the context
(400, code context_length_exceeded); max_tokens capped to the server's --max-tokens-cap; full queue (429 with
Retry-After); malformed JSON or wrong types (400); a body not received within --body-timeout seconds (408). A
client that disconnects (streaming or not) has its row dropped at the next engine step.

Run: `blockdraft serve --target T --draft D --method M ...` (the options are in cli/serve.py, their typed
form in serve/config.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import ipaddress
import json
import logging
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..decode.spec import build_engine
from ..models.loading import load_draft, load_target, resolve_draft
from .config import ServeConfig
from .metrics import ServerMetrics
from .scheduler import LockedTokenizer, QueueFullError, RequestHandle, Scheduler, SchedulerClosedError
from .schema import APIError, ParsedRequest, RequestParser

log = logging.getLogger("blockdraft.serve")


# ------------------------------------------------------------------------------------------------ the app
@dataclass
class ServerSettings:
    model_name: str
    draft_name: str
    max_context: int
    vocab_size: int
    api_key: str | None = None
    max_tokens_cap: int = 512
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0  # seconds to receive a whole request body (then 408): a stalled upload is dropped
    max_prompt_tokens: int | None = None  # longer prompts get a 400 (None: only the context bounds them)


def _stats_extra(result, handle: RequestHandle, draft_name: str) -> dict:
    s = result.stats
    queued = (handle.started_at - handle.submitted_at) if handle.started_at else 0.0
    return {"draft": draft_name, "tau": round(s.tau, 4), "target_forwards": s.target_forwards,
            "accept_lengths": s.accept_lengths, "prefill_seconds": round(s.prefill_seconds, 4),
            "decode_seconds": round(s.decode_seconds, 4), "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
            "queue_seconds": round(queued, 4)}


def create_app(scheduler: Scheduler, tokenizer, settings: ServerSettings):
    """The Starlette application. The scheduler is started on startup and stopped on shutdown."""
    parser = RequestParser(tokenizer, settings.model_name, settings.max_context, settings.max_tokens_cap,
                           settings.vocab_size, settings.max_prompt_tokens)
    metrics = ServerMetrics(scheduler.queue_state, lambda: scheduler.engine.plain_steps)
    # Requests are parsed (tokenized) off the event loop on ONE thread: the tokenizer is locked anyway, so more threads
    # add no throughput, and with anyio's pool of up to 40 threads the server's RSS crept up (blockdraft soak on the
    # tiny test model: 466 -> 498 MB over 1000 requests; one thread: flat at 478 MB over 2100). Python objects were
    # not leaking (tracemalloc); glibc gives each thread its own malloc arena, each with its own high-water mark.
    parse_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockdraft-parse")
    scheduler.on_finish = metrics.request_finished
    created = int(time.time())

    def check_auth(request: Request) -> None:
        if not settings.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: Request):
        limit = settings.max_body_bytes
        too_big = APIError(413, f"the request body exceeds the server's limit of {limit} bytes",
                           code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise too_big
            except ValueError:
                raise APIError(400, "invalid Content-Length header", code="invalid_request") from None

        async def receive_body() -> bytearray:
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big
            return body

        try:
            body = await asyncio.wait_for(receive_body(), settings.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {settings.body_timeout:g} s",
                           code="request_timeout") from None
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request ({e}).",
                           code="invalid_json") from None
        except RecursionError:  # json's C parser gives up past ~1000 levels; a real request has fewer than 10
            raise APIError(400, "We could not parse the JSON body of your request (nested too deeply).",
                           code="invalid_json") from None

    async def health(request: Request):
        m = scheduler.metrics()
        ok = m["worker_alive"]
        return JSONResponse({"status": "ok" if ok else "error", "model": settings.model_name,
                             "draft": settings.draft_name, **m}, status_code=200 if ok else 503)

    async def prometheus(request: Request):
        return Response(metrics.render(), media_type=metrics.content_type)

    async def models(request: Request):
        try:
            check_auth(request)
        except APIError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [
            {"id": settings.model_name, "object": "model", "created": created, "owned_by": "blockdraft",
             "max_model_len": settings.max_context, "draft": settings.draft_name}]})

    async def wait_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def completion_endpoint(request: Request, chat: bool):
        try:
            check_auth(request)
            body = await read_json(request)
            req = await asyncio.get_running_loop().run_in_executor(parse_pool, parser.parse, body, chat)
            handle = scheduler.submit(req.prompt_ids, req.config, req.sampling, loop=asyncio.get_running_loop())
        except APIError as e:
            return e.response()
        except QueueFullError as e:
            return APIError(429, str(e), type="rate_limit_error", code="queue_full",
                            headers={"Retry-After": str(e.retry_after)}).response()
        except SchedulerClosedError as e:
            return APIError(503, str(e), type="server_error", code="unavailable").response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        ts = int(time.time())
        if req.stream:
            return StreamingResponse(sse(handle, req, rid, ts, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, handle, req, rid, ts, chat)

    def usage(req: ParsedRequest, result) -> dict:
        n = len(result.token_ids)
        return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n, "total_tokens": len(req.prompt_ids) + n}

    async def collect(request: Request, handle: RequestHandle, req: ParsedRequest, rid: str, ts: int, chat: bool):
        async def consume():
            async for _ in handle.aevents():
                pass

        task = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():  # the client went away (or we are being cancelled): free the row now
                scheduler.cancel(handle)
                task.cancel()
        if not task.done() or task.cancelled():
            return JSONResponse({"error": {"message": "client disconnected", "type": "invalid_request_error",
                                           "param": None, "code": "client_closed"}}, status_code=499)
        if handle.error is not None:
            return APIError(500, handle.error, type="server_error", code="internal_error").response()
        result = handle.result
        fr = result.finish_reason if result.finish_reason in ("stop", "length") else "stop"
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                      "finish_reason": fr}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": fr}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": ts,
                             "model": settings.model_name, "choices": [choice], "usage": usage(req, result),
                             "blockdraft": _stats_extra(result, handle, settings.draft_name)})

    async def sse(handle: RequestHandle, req: ParsedRequest, rid: str, ts: int, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            d = {"id": rid, "object": obj, "created": ts, "model": settings.model_name, "choices": choices}
            if req.include_usage:
                d["usage"] = None
            d.update(extra)
            return f"data: {json.dumps(d)}\n\n"

        def choice(text: str | None, finish=None, role: bool = False) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", "content": ""}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        try:
            if chat:
                yield chunk([choice(None, role=True)])
            async for ev in handle.aevents():
                if ev.kind == "delta" and ev.text:
                    yield chunk([choice(ev.text)])
                elif ev.kind == "done":
                    result = ev.result
                    fr = result.finish_reason if result.finish_reason in ("stop", "length") else "stop"
                    extra = _stats_extra(result, handle, settings.draft_name)
                    yield chunk([choice(None if chat else "", finish=fr)], blockdraft=extra)
                    if req.include_usage:
                        yield chunk([], usage=usage(req, result), blockdraft=extra)
                elif ev.kind == "error":
                    err = APIError(500, ev.error or "internal error", type="server_error", code="internal_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not handle.done:  # the client disconnected mid-stream: free its row at the next step
                scheduler.cancel(handle)

    async def chat_completions(request: Request):
        return await completion_endpoint(request, chat=True)

    async def completions(request: Request):
        return await completion_endpoint(request, chat=False)

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return APIError(500, "internal server error", type="server_error", code="internal_error").response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()
            parse_pool.shutdown(wait=False)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(_CountResponses, metrics=metrics)],
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.scheduler = scheduler
    return app


class _CountResponses:
    """ASGI middleware: counts every HTTP answer by endpoint and status (an exception counts as the 500 it becomes)."""

    def __init__(self, app, metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.count_response(scope["path"], status)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server(cfg: ServeConfig):
    """Load the model and build (app, settings) from a ServeConfig. Separate from serve_main so that tests and
    benchmarks can reuse it."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.set_grad_enabled(False)
    spec = cfg.decode_spec()
    target, src = load_target(cfg.target, cfg.dtype, weights=cfg.weights, decode_only=True)
    if target.tokenizer is None:
        raise ValueError("the server needs the target's tokenizer")
    tokenizer = LockedTokenizer(target.tokenizer)
    path = resolve_draft(cfg.draft, src.name) if spec.entry.draft is not None else None
    # the target's verify cost per width, if the spec needs it: cached per machine, measured now (~30 s) if not
    engine = build_engine(target, load_draft(path, target) if path is not None else None, spec, tokenizer=tokenizer,
                          max_batch=cfg.max_batch, max_step_tokens=cfg.max_step_tokens,
                          draft_max_batch=cfg.draft_max_batch or None)
    method = engine.spec.method
    draft_name = method if path is None else path.name if method == "dflash" else f"{path.name} ({method})"
    if method == "ar":
        draft_name = "none"
    scheduler = Scheduler(engine, max_queue=cfg.max_queue, step_delay=cfg.debug_step_delay)
    settings = ServerSettings(model_name=src.name, draft_name=draft_name, max_context=target.max_context,
                              vocab_size=target.vocab_size, api_key=cfg.api_key,
                              max_tokens_cap=cfg.max_tokens_cap, max_body_bytes=cfg.max_body_bytes,
                              body_timeout=cfg.body_timeout,
                              max_prompt_tokens=cfg.max_prompt_tokens or None)
    return create_app(scheduler, tokenizer, settings), settings


def serve_main(cfg: ServeConfig) -> int:
    """Run the server of a ServeConfig until SIGINT / SIGTERM."""
    if not _is_loopback(cfg.host) and not cfg.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this address can use the server", cfg.host)
    app, settings = build_server(cfg)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
    sock.listen(128)
    port = sock.getsockname()[1]
    shown = f"[{cfg.host}]" if family == socket.AF_INET6 else cfg.host
    print(f"blockdraft serve: model {settings.model_name} (draft {settings.draft_name}) listening on "
          f"http://{shown}:{port}", flush=True)
    config = uvicorn.Config(app, log_level=cfg.log_level, timeout_graceful_shutdown=3,
                            access_log=cfg.log_level in ("debug", "info"))
    server = uvicorn.Server(config)
    scheduler = app.state.scheduler

    def http() -> None:  # the HTTP side in a thread; the engine keeps the main thread (Scheduler.run says why)
        try:
            server.run(sockets=[sock])
        finally:
            scheduler.stop()

    def exit_on(signum, frame) -> None:
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, exit_on)
    scheduler.claim()
    thread = threading.Thread(target=http, name="blockdraft-http")
    thread.start()
    scheduler.run()  # returns once the HTTP side has shut down and stopped it
    thread.join()
    return 0
