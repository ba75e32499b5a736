"""The OpenAI request schema: validate a chat or completion request body and turn it into prompt ids and generation
settings, or raise an `APIError` that the app answers as OpenAI does ({"error": {message, type, param, code}}).

Hand-written rather than pydantic models (as vLLM uses), after trying both on the same 21 invalid bodies: pydantic
would save ~40 lines of type checks, but its messages were less clear wherever the schema has a union or a
"supported only at its neutral value" field, and fixing that needs about as much code again in custom validators
and an error-type-to-message table. Examples (pydantic's first error, then this parser's):
  content=[{"type": "image_url"}]: "'messages.0.content.str': Input should be a valid string" (4 errors) vs
      "messages[0].content[0]: only text parts are supported" (code unsupported_parameter);
  logprobs=true: "'logprobs': Input should be False" vs "'logprobs' is not supported by this server (only null or
      false is accepted)"; tools=[...]: "List should have at most 0 items after validation" vs the same
      not-supported message; n=3: "Input should be less than or equal to 1" vs "'n' > 1 is not supported";
  prompt=12: "'prompt.str': Input should be a valid string" (4 errors) vs "'prompt' must be a string, a list of token
      ids, or a list holding one of those".
Type checks are strict (true is not 1, 1 is not "1", NaN and Infinity are not numbers), values shown in messages are
cut to a short excerpt, and unknown fields are refused by name, as OpenAI does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..config import GenerationConfig, SamplingParams
from ..models.loading import encode_prompt

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


def _show(v, limit: int = 60) -> str:
    """A short JSON excerpt of a client's value for an error message (values can be megabytes or nested deeply)."""
    try:
        text = json.dumps(v)
    except (ValueError, TypeError, RecursionError):
        text = type(v).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _get_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"'{key}' must be an integer, got {_show(v)}", key, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(f"'{key}' must be {rng}, got {v}", key)
    return v


def _get_num(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_num(v):
        raise _bad(f"'{key}' must be a number, got {_show(v)}", key, "invalid_type")
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return float(v)


def _get_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {_show(v)}", key, "invalid_type")
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

    def __init__(self, tokenizer, model_name: str, max_context: int, max_tokens_cap: int, vocab_size: int,
                 max_prompt_tokens: int | None = None) -> None:
        self.tokenizer, self.model_name, self.max_context = tokenizer, model_name, max_context
        self.max_tokens_cap, self.vocab_size = max_tokens_cap, vocab_size
        self.max_prompt_tokens = max_prompt_tokens  # None: only the context bounds a prompt

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
            shown = key if len(key) <= 60 else key[:60] + "..."
            raise _bad(f"Unrecognized request argument supplied: {shown}", shown, "unsupported_parameter")
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
            raise _bad(f"'user' must be a string, got {_show(user)}", "user", "invalid_type")

        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
            # the prefill of a prompt runs inside one engine step: a bound on prompts is a bound on how long every
            # other stream can be held up by one admission
            raise APIError(400, f"The prompt has {len(prompt_ids)} tokens; this server accepts at most "
                                f"{self.max_prompt_tokens} (--max-prompt-tokens). Please shorten the prompt.",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
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
            if not stream:  # as OpenAI answers: the options would be silently ignored otherwise
                raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
            if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
                raise _bad("'stream_options' must be an object with 'include_usage'", "stream_options")
            include_usage = bool(_get_bool(opts, "include_usage"))
            _get_bool(opts, "continuous_usage_stats")
        try:
            sampling = SamplingParams(temperature=temperature if temperature is not None else 1.0,
                                      top_p=top_p if top_p is not None else 1.0,
                                      top_k=0 if top_k in (None, -1) else top_k, seed=seed)
            config = GenerationConfig(max_new_tokens=max_tokens, stop_strings=stops, ignore_eos=ignore_eos)
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
                raise _bad(f"{where} has unsupported fields {_show(sorted(extra))} (tool calls are not supported)",
                           where, "unsupported_parameter")
            if m.get("name") is not None and not isinstance(m["name"], str):
                raise _bad(f"{where}.name must be a string, got {_show(m['name'])}", f"{where}.name", "invalid_type")
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise _bad(f"{where}.role must be one of system, developer, user, assistant; got {_show(role)}",
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
        try:
            return encode_prompt(self.tokenizer, clean)
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation (e.g. role order)
            raise _bad(f"the chat template rejected these messages: {e}", "messages") from None

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            try:
                ids = list(self.tokenizer.encode(prompt))
            except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate ("\ud800") that is valid JSON, not UTF-8
                raise _bad(f"the prompt cannot be tokenized: {type(e).__name__}", "prompt") from None
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

