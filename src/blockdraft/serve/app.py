"""An OpenAI-compatible HTTP server (Starlette + uvicorn) over the batched speculative engine.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with `stream: true` as server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`), GET /v1/models, GET /health (status and live metrics).

Honoured parameters: model (must be the served one), messages / prompt, max_tokens (chat: also
max_completion_tokens), temperature, top_p, top_k (extension), seed, stop (string or list of up to 4), n=1,
stream, stream_options.include_usage, ignore_eos (extension), user. Parameters the server cannot honour (n>1,
logprobs, tools, penalties, logit_bias, response_format other than text, ...) are refused with an OpenAI-style
error object and status 400 when set to anything but their neutral value; unknown parameters are refused too.

Every response carries `usage` and a `blockdraft` object with the acceptance figures (tau = mean tokens committed
per target forward, target_forwards, accept_lengths, draft name, timings).

Limits: binds 127.0.0.1 by default; optional API key (401); request body limit (413); prompt longer than the context
(400, code context_length_exceeded); max_tokens capped to the server's --max-tokens-cap; full queue (429 with
Retry-After); malformed JSON or wrong types (400). A client that disconnects (streaming or not) has its row
dropped at the next engine step.

Run: `python -m blockdraft.serve.app --target T --draft D ...` (or `blockdraft serve ...` once registered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field

from ..config import GenerationConfig, SamplingParams
from .scheduler import QueueFullError, RequestHandle, Scheduler, SchedulerClosedError

log = logging.getLogger("blockdraft.serve")

MAX_STOP_SEQUENCES = 4


# ------------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------------------------------ request validation
# Parameters the server does not implement: accepted only at their neutral value, refused otherwise.
_NEUTRAL = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
           "user", "ignore_eos"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_COMPLETION = _COMMON | {"prompt"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _get_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"'{key}' must be an integer, got {json.dumps(v)}", key, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(f"'{key}' must be {rng}, got {v}", key)
    return v


def _get_num(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_num(v):
        raise _bad(f"'{key}' must be a number, got {json.dumps(v)}", key, "invalid_type")
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return float(v)


def _get_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {json.dumps(v)}", key, "invalid_type")
    return v


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    config: GenerationConfig
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)


class RequestParser:
    """Validates a request body and turns it into prompt ids + generation settings (or raises APIError)."""

    def __init__(self, tokenizer, model_name: str, max_context: int, max_tokens_cap: int, block_size: int | None,
                 vocab_size: int) -> None:
        self.tokenizer, self.model_name, self.max_context = tokenizer, model_name, max_context
        self.max_tokens_cap, self.block_size, self.vocab_size = max_tokens_cap, block_size, vocab_size

    def parse(self, body, chat: bool) -> ParsedRequest:
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_type")
        allowed = _CHAT if chat else _COMPLETION
        for key, value in body.items():
            if key in allowed:
                continue
            if key in _NEUTRAL:
                if not any(_same(value, n) for n in _NEUTRAL[key]):
                    raise _bad(f"'{key}' is not supported by this server (only {_neutral_text(key)} is accepted)",
                               key, "unsupported_parameter")
                continue
            raise _bad(f"Unrecognized request argument supplied: {key}", key, "unsupported_parameter")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _bad("'model' is required and must be a string", "model", "invalid_type")
        if model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        n = _get_int(body, "n", 1)
        if n is not None and n != 1:
            raise _bad("'n' > 1 is not supported by this server (one choice per request)", "n",
                       "unsupported_parameter")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise _bad("'user' must be a string", "user", "invalid_type")

        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        if len(prompt_ids) >= self.max_context:
            raise APIError(400, f"This model's maximum context length is {self.max_context} tokens, but the prompt "
                                f"has {len(prompt_ids)} tokens (at least one token must remain for the completion). "
                                "Please shorten the prompt.", param="messages" if chat else "prompt",
                           code="context_length_exceeded")

        max_tokens = _get_int(body, "max_tokens", 1)
        if chat:
            mct = _get_int(body, "max_completion_tokens", 1)
            max_tokens = mct if mct is not None else max_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens_cap if chat else min(16, self.max_tokens_cap)  # OpenAI's legacy default
        max_tokens = min(max_tokens, self.max_tokens_cap)

        temperature = _get_num(body, "temperature", 0.0, 2.0)
        top_p = _get_num(body, "top_p", 0.0, 1.0)
        if top_p is not None and top_p <= 0.0:
            raise _bad("'top_p' must be in (0, 1]", "top_p")
        top_k = _get_int(body, "top_k", -1)
        seed = _get_int(body, "seed", -(1 << 63), (1 << 63) - 1)
        ignore_eos = _get_bool(body, "ignore_eos") or False
        stop = body.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _bad(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise _bad("stop sequences must be non-empty strings", "stop")
        stream = _get_bool(body, "stream") or False
        include_usage = False
        opts = body.get("stream_options")
        if opts is not None:
            if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
                raise _bad("'stream_options' must be an object with 'include_usage'", "stream_options")
            include_usage = bool(_get_bool(opts, "include_usage"))
        try:
            sampling = SamplingParams(temperature=temperature if temperature is not None else 1.0,
                                      top_p=top_p if top_p is not None else 1.0,
                                      top_k=0 if top_k in (None, -1) else top_k, seed=seed)
            config = GenerationConfig(max_new_tokens=max_tokens, block_size=self.block_size, stop_strings=stops,
                                      ignore_eos=ignore_eos)
        except ValueError as e:
            raise _bad(str(e)) from None
        return ParsedRequest(prompt_ids, config, sampling, stream, include_usage)

    # ------------------------------------------------------------------------------------------ prompts
    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list of messages", "messages", "invalid_type")
        clean = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise _bad(f"{where} must be an object", where, "invalid_type")
            extra = set(m) - {"role", "content", "name"}
            if extra:
                raise _bad(f"{where} has unsupported fields {sorted(extra)} (tool calls are not supported)", where,
                           "unsupported_parameter")
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise _bad(f"{where}.role must be one of system, developer, user, assistant; got {json.dumps(role)}",
                           f"{where}.role", "invalid_value")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    is_text = isinstance(part, dict) and part.get("type") == "text"
                    if not (is_text and isinstance(part.get("text"), str)):
                        raise _bad(f"{where}.content[{j}]: only text parts are supported", f"{where}.content",
                                   "unsupported_parameter")
                    parts.append(part["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                           "invalid_type")
            clean.append({"role": "system" if role == "developer" else role, "content": content})
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages",
                           code="no_chat_template")
        from ..loading import encode_prompt

        try:
            return encode_prompt(self.tokenizer, clean)
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation (e.g. role order)
            raise _bad(f"the chat template rejected these messages: {e}", "messages") from None

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            if any(not 0 <= t < self.vocab_size for t in prompt):
                raise _bad(f"prompt token ids must be in 0..{self.vocab_size - 1}", "prompt")
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _bad("only one prompt per request is supported", "prompt", "unsupported_parameter")
        else:
            raise _bad("'prompt' must be a string, a list of token ids, or a list holding one of those", "prompt",
                       "invalid_type")
        if not ids:
            raise _bad("the prompt is empty", "prompt")
        return ids


def _same(value, neutral) -> bool:
    """value equals a neutral setting (booleans and None by identity, so False is not 0 and 0 is not False)."""
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)) and isinstance(value, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def _neutral_text(key: str) -> str:
    return " or ".join(json.dumps(v) for v in _NEUTRAL[key])


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
    block_size: int | None = None


def _stats_extra(result, handle: RequestHandle, draft_name: str) -> dict:
    s = result.stats
    queued = (handle.started_at - handle.submitted_at) if handle.started_at else 0.0
    return {"draft": draft_name, "tau": round(s.tau, 4), "target_forwards": s.target_forwards,
            "accept_lengths": s.accept_lengths, "prefill_seconds": round(s.prefill_seconds, 4),
            "decode_seconds": round(s.decode_seconds, 4), "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
            "queue_seconds": round(queued, 4)}


def create_app(scheduler: Scheduler, tokenizer, settings: ServerSettings):
    """The Starlette application. The scheduler is started on startup and stopped on shutdown."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    parser = RequestParser(tokenizer, settings.model_name, settings.max_context, settings.max_tokens_cap,
                           settings.block_size, settings.vocab_size)
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
                raise _bad("invalid Content-Length header", None, "invalid_request") from None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"We could not parse the JSON body of your request ({e}).", None, "invalid_json") from None

    async def health(request: Request):
        m = scheduler.metrics()
        ok = m["worker_alive"]
        return JSONResponse({"status": "ok" if ok else "error", "model": settings.model_name,
                             "draft": settings.draft_name, **m}, status_code=200 if ok else 503)

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
            req = await run_in_threadpool(parser.parse, body, chat)  # tokenizing must not stall the event loop
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

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})


# ---------------------------------------------------------------------------------------- command line
def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF id, local dir or .gguf file (default: packaged SmolLM2-135M)")
    p.add_argument("--draft", default=None,
                   help="draft directory, 'none' for plain decoding, 'pld' for prompt lookup (default: shipped)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--block-size", type=int, default=None, help="tokens per verify step (default: the draft's)")
    p.add_argument("--denoise-steps", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one; printed at start)")
    p.add_argument("--api-key", default=os.environ.get("BLOCKDRAFT_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $BLOCKDRAFT_API_KEY, else none)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond max-batch (then 429)")
    p.add_argument("--max-tokens-cap", type=int, default=512, help="upper bound on max_tokens per request")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="verified positions per step shared by all rows (default: no limit, full blocks)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body size limit (then 413)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--debug-step-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # testing aid


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to a CLI's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculative decoding")
    add_serve_args(p)
    p.set_defaults(func=serve_main)
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server(args):
    """Load the model and build (app, settings). Separate from serve_main so that tests and benchmarks can reuse it."""
    import torch

    from ..batch import BatchedEngine
    from ..loading import load_target, resolve_draft
    from .scheduler import LockedTokenizer

    if args.max_batch < 1 or args.max_queue < 0 or args.max_tokens_cap < 1 or args.max_body_bytes < 1:
        raise ValueError("--max-batch and --max-tokens-cap must be >= 1, --max-queue >= 0, --max-body-bytes >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target, src = load_target(args.target, args.dtype)
    if target.tokenizer is None:
        raise ValueError("the server needs the target's tokenizer")
    proposer, draft_name = None, "none"
    if args.draft is not None and args.draft.lower() in ("pld", "lookup"):
        from ..proposers.lookup import PromptLookupProposer

        proposer, draft_name = PromptLookupProposer(block_size=args.block_size or 16), "pld"
    else:
        draft_path = resolve_draft(args.draft, src.name)
        if draft_path is not None:
            from ..draft import DFlashDraftModel
            from ..proposers.dflash import DFlashProposer

            draft = DFlashDraftModel.from_pretrained(draft_path, dtype=target.dtype, device=target.device)
            proposer = DFlashProposer(draft, target, args.block_size, args.denoise_steps)
            draft_name = draft_path.name
    tokenizer = LockedTokenizer(target.tokenizer)
    engine = BatchedEngine(target, proposer, tokenizer, max_batch=args.max_batch,
                           max_step_tokens=getattr(args, "max_step_tokens", None))
    scheduler = Scheduler(engine, max_queue=args.max_queue, step_delay=args.debug_step_delay)
    settings = ServerSettings(model_name=src.name, draft_name=draft_name, max_context=target.max_context,
                              vocab_size=target.vocab_size, api_key=args.api_key,
                              max_tokens_cap=args.max_tokens_cap, max_body_bytes=args.max_body_bytes,
                              block_size=args.block_size)
    return create_app(scheduler, tokenizer, settings), settings


def serve_main(args) -> int:
    import uvicorn

    if not _is_loopback(args.host) and not args.api_key:
        log.warning("binding %s without --api-key: anyone who can reach this address can use the server", args.host)
    app, settings = build_server(args)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    sock.listen(128)
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"blockdraft serve: model {settings.model_name} (draft {settings.draft_name}) listening on "
          f"http://{shown}:{port}", flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=3,
                            access_log=args.log_level in ("debug", "info"))
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockdraft.serve.app", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true")
    add_serve_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return serve_main(args)
    except (ValueError, FileNotFoundError, NotImplementedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
