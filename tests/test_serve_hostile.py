"""Hostile input: a corpus of malformed and adversarial requests to every endpoint of a real server process (tiny
target). Each must get a 4xx with an OpenAI-style error body, never a 5xx, and the server must stay healthy and keep
answering correctly. Stalled uploads (slowloris-style partial bodies) are dropped with a 408 after --body-timeout."""

from __future__ import annotations

import json
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_helpers import API_KEY, Server, tiny_model_dir

BODY_LIMIT, BODY_TIMEOUT, CAP = 65536, 2.0, 8
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    target_dir, draft_dir = tiny_model_dir(out)
    srv = Server(["--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "fp32", "--api-key", API_KEY,
                  "--max-batch", "2", "--max-queue", "2", "--max-tokens-cap", str(CAP),
                  "--max-body-bytes", str(BODY_LIMIT), "--body-timeout", str(BODY_TIMEOUT)], out / "server.log")
    srv.model = target_dir.name
    yield srv
    srv.stop()
    log = (out / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def _corpus(model: str, max_context: int) -> list[tuple[str, str, str, dict, bytes | None, int]]:
    """(name, method, path, extra headers, raw body, expected status). Bodies are bytes so that invalid JSON, invalid
    UTF-8 and raw control characters reach the server as sent."""
    msgs = [{"role": "user", "content": "Hi"}]

    def chat(**kw):
        return _j({"model": model, "messages": msgs, "max_tokens": 2, **kw})

    def comp(**kw):
        return _j({"model": model, "max_tokens": 2, **{"prompt": "Hi", **kw}})

    def chat_raw(fragment: str) -> bytes:  # a chat body with one field written as raw JSON text
        return ('{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], %s}' % (model, fragment)).encode()

    cases = [
        # malformed JSON
        ("not json", "POST", CHAT, {}, b"{not json", 400),
        ("empty body", "POST", CHAT, {}, b"", 400),
        ("json null", "POST", COMP, {}, b"null", 400),
        ("json array", "POST", CHAT, {}, b"[1, 2]", 400),
        ("json string", "POST", COMP, {}, b'"hello"', 400),
        ("truncated", "POST", CHAT, {}, b'{"model": "x", "messages": [', 400),
        ("trailing garbage", "POST", COMP, {}, comp() + b"}}", 400),
        ("deep list nesting (5000)", "POST", CHAT, {},
         ('{"model": "x", "messages": ' + "[" * 5000 + "]" * 5000 + "}").encode(), 400),
        ("deep object nesting (3000)", "POST", COMP, {}, ('{"a": ' * 3000 + "1" + "}" * 3000).encode(), 400),
        ("deep nesting in a field (900)", "POST", CHAT, {}, chat_raw('"temperature": ' + "[" * 900 + "]" * 900),
         400),
        # huge numbers, NaN and Infinity
        ("max_tokens 1e400", "POST", CHAT, {}, chat_raw('"max_tokens": 1e400'), 400),
        ("temperature 1e308", "POST", CHAT, {}, chat(temperature=1e308), 400),
        ("seed 2**64", "POST", COMP, {}, comp(seed=2 ** 64), 400),
        ("top_k -5", "POST", CHAT, {}, chat(top_k=-5), 400),
        ("top_p 0", "POST", CHAT, {}, chat(top_p=0), 400),
        ("temperature -1", "POST", COMP, {}, comp(temperature=-1), 400),
        ("n 0", "POST", CHAT, {}, chat(n=0), 400),
        ("temperature NaN", "POST", CHAT, {}, chat_raw('"temperature": NaN'), 400),
        ("top_p Infinity", "POST", CHAT, {}, chat_raw('"top_p": Infinity'), 400),
        ("max_tokens -Infinity", "POST", COMP, {}, ('{"model": "%s", "prompt": "x", "max_tokens": -Infinity}'
                                                     % model).encode(), 400),
        # wrong types everywhere
        ("model int", "POST", COMP, {}, comp(model=7), 400),
        ("model missing", "POST", CHAT, {}, _j({"messages": msgs}), 400),
        ("messages string", "POST", CHAT, {}, chat(messages="hello"), 400),
        ("messages empty", "POST", CHAT, {}, chat(messages=[]), 400),
        ("message not object", "POST", CHAT, {}, chat(messages=[5]), 400),
        ("message without content", "POST", CHAT, {}, chat(messages=[{"role": "user"}]), 400),
        ("unknown role", "POST", CHAT, {}, chat(messages=[{"role": "robot", "content": "x"}]), 400),
        ("content int", "POST", CHAT, {}, chat(messages=[{"role": "user", "content": 5}]), 400),
        ("image content part", "POST", CHAT, {}, chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400),
        ("name int", "POST", CHAT, {}, chat(messages=[{"role": "user", "content": "x", "name": 5}]), 400),
        ("stream string", "POST", CHAT, {}, chat(stream="yes"), 400),
        ("max_tokens string", "POST", COMP, {}, comp(max_tokens="10"), 400),
        ("max_tokens bool", "POST", CHAT, {}, chat(max_tokens=True), 400),
        ("temperature string", "POST", CHAT, {}, chat(temperature="hot"), 400),
        ("seed float", "POST", COMP, {}, comp(seed=1.5), 400),
        ("user int", "POST", CHAT, {}, chat(user=5), 400),
        ("ignore_eos string", "POST", COMP, {}, comp(ignore_eos="no"), 400),
        ("prompt int", "POST", COMP, {}, comp(prompt=12), 400),
        ("prompt mixed list", "POST", COMP, {}, comp(prompt=[1, "a"]), 400),
        ("prompt negative id", "POST", COMP, {}, comp(prompt=[-1]), 400),
        ("prompt huge id", "POST", COMP, {}, comp(prompt=[10 ** 12]), 400),
        ("prompt bools", "POST", COMP, {}, comp(prompt=[True, False]), 400),
        ("two prompts", "POST", COMP, {}, comp(prompt=["a", "b"]), 400),
        ("prompt empty string", "POST", COMP, {}, comp(prompt=""), 400),
        ("prompt empty list", "POST", COMP, {}, comp(prompt=[]), 400),
        ("prompt at the context length", "POST", COMP, {}, comp(prompt=[5] * max_context), 400),
        # unknown fields
        ("unknown field", "POST", CHAT, {}, chat(frobnicate=1), 400),
        ("10k-character field name", "POST", COMP, {}, comp(**{"k" * 10_000: 1}), 400),
        ("tool_calls in a message", "POST", CHAT, {}, chat(messages=[{"role": "assistant", "content": "x",
                                                                      "tool_calls": []}]), 400),
        # empty and oversized strings
        ("model empty", "POST", CHAT, {}, chat(model=""), 400),
        ("unknown model", "POST", CHAT, {}, chat(model="gpt-4"), 404),
        ("oversized prompt", "POST", COMP, {}, comp(prompt="x" * (BODY_LIMIT + 10)), 413),
        ("oversized content", "POST", CHAT, {}, chat(messages=[{"role": "user", "content": "y" * BODY_LIMIT}]), 413),
        ("Content-Length beyond the limit", "POST", COMP, {"Content-Length": str(10 ** 12)}, comp(), 413),
        # invalid UTF-8, lone surrogates, raw control characters
        ("invalid UTF-8", "POST", COMP, {}, b'{"model": "x", "prompt": "\xff\xfe\xfd"}', 400),
        ("lone surrogate", "POST", COMP, {}, comp(prompt="\ud800"), 400),
        ("raw control character", "POST", CHAT, {}, chat_raw('"user": "a\x01b"'), 400),
        ("NUL byte", "POST", COMP, {}, b'{"model": "x",\x00 "prompt": "a"}', 400),
        # stop lists
        ("five stop strings", "POST", CHAT, {}, chat(stop=["a", "b", "c", "d", "e"]), 400),
        ("empty stop string", "POST", COMP, {}, comp(stop=[""]), 400),
        ("stop ints", "POST", CHAT, {}, chat(stop=[1]), 400),
        ("stop object", "POST", COMP, {}, comp(stop={}), 400),
        # features the server does not implement
        ("logit_bias", "POST", CHAT, {}, chat(logit_bias={"5": 10}), 400),
        ("response_format json", "POST", CHAT, {}, chat(response_format={"type": "json_object"}), 400),
        ("tools", "POST", CHAT, {}, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
        ("tool_choice auto", "POST", CHAT, {}, chat(tool_choice="auto"), 400),
        ("logprobs", "POST", COMP, {}, comp(logprobs=5), 400),
        ("n 2", "POST", CHAT, {}, chat(n=2), 400),
        ("presence_penalty", "POST", CHAT, {}, chat(presence_penalty=0.5), 400),
        ("echo", "POST", COMP, {}, comp(echo=True), 400),
        # streaming options
        ("include_usage string", "POST", CHAT, {}, chat(stream=True, stream_options={"include_usage": "yes"}), 400),
        ("stream_options without stream", "POST", CHAT, {}, chat(stream_options={"include_usage": True}), 400),
        ("stream_options list", "POST", COMP, {}, comp(stream=True, stream_options=[1]), 400),
        ("stream_options unknown key", "POST", CHAT, {}, chat(stream=True, stream_options={"bogus": 1}), 400),
        # wrong methods and paths
        ("GET chat", "GET", CHAT, {}, None, 405),
        ("PUT completions", "PUT", COMP, {}, comp(), 405),
        ("DELETE models", "DELETE", "/v1/models", {}, None, 405),
        ("POST health", "POST", "/health", {}, b"{}", 405),
        ("POST metrics", "POST", "/metrics", {}, b"{}", 405),
        ("unknown path", "GET", "/v1/engines", {}, None, 404),
        ("path traversal", "GET", "/v1/../../etc/passwd", {}, None, 404),
        # authentication
        ("chat without key", "POST", CHAT, {"Authorization": ""}, chat(), 401),
        ("completions wrong key", "POST", COMP, {"Authorization": "Bearer sk-wrong"}, comp(), 401),
        ("models without key", "GET", "/v1/models", {"Authorization": ""}, None, 401),
        ("basic auth scheme", "POST", CHAT, {"Authorization": "Basic " + API_KEY}, chat(), 401),
        # wrong content types
        ("form body", "POST", COMP, {"Content-Type": "application/x-www-form-urlencoded"}, b"model=x&prompt=y", 400),
        ("multipart body", "POST", CHAT, {"Content-Type": "multipart/form-data; boundary=XX"},
         b"--XX\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nx\r\n--XX--\r\n", 400),
    ]
    return cases


def _send(srv: Server, method: str, path: str, headers: dict, raw: bytes | None):
    h = dict(AUTH, **headers)
    if h.get("Authorization") == "":
        del h["Authorization"]
    return srv.request(method, path, headers=h, raw=raw)


def _http_counts(srv: Server) -> dict[tuple[str, str], float]:
    text = srv.request("GET", "/metrics")[2]
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "blockdraft:http_requests")
    return {(s.labels["endpoint"], s.labels["status"]): s.value for s in fam.samples if s.name.endswith("_total")}


def test_hostile_corpus_gets_openai_4xx_and_server_stays_healthy(server):
    max_context = server.get("/v1/models")[2]["data"][0]["max_model_len"]
    cases = _corpus(server.model, max_context)
    assert len(cases) >= 50 and len({c[0] for c in cases}) == len(cases)
    assert {path for _, _, path, _, _, _ in cases} >= {CHAT, COMP, "/v1/models", "/health", "/metrics"}
    wrong = []
    for name, method, path, headers, raw, expected in cases:
        status, _, body = _send(server, method, path, headers, raw)
        err = body.get("error") if isinstance(body, dict) else None
        shaped = isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and err["message"]
        if status != expected or not shaped:
            wrong.append((name, status, expected, str(body)[:200]))
    assert not wrong, "\n".join(map(str, wrong))
    # the server is healthy and still answers correctly
    h = server.health()
    assert h["status"] == "ok" and h["worker_alive"] and h["errors"] == 0 and h["active"] == h["queued"] == 0
    status, _, body = server.post(COMP, {"model": server.model, "prompt": "Once upon", "max_tokens": 4,
                                         "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    counts = _http_counts(server)
    assert not {k: v for k, v in counts.items() if k[1].startswith("5")}, counts
    assert sum(v for k, v in counts.items() if k[1].startswith("4")) >= len(cases)


def test_adversarial_but_valid_requests_are_answered(server):
    """Strange yet legal requests get a 200 (refusing them would be the bug): escaped control characters, emoji,
    max_tokens far above the cap (clamped), extreme seeds, a one-token prompt list, a batch of one prompt."""
    m = server.model
    bodies = [
        (CHAT, {"model": m, "messages": [{"role": "user", "content": "a\u0000b\u0001\u001f\u007f"}]}),
        (CHAT, {"model": m, "messages": [{"role": "system", "content": ""},
                                         {"role": "user", "content": "\U0001F600" * 20}],
                "stream": True, "stream_options": {"include_usage": True}}),
        (COMP, {"model": m, "prompt": "x", "max_tokens": 10 ** 40, "seed": -(2 ** 63), "temperature": 2.0,
                "top_k": 10 ** 9}),
        (COMP, {"model": m, "prompt": [7], "top_p": 1e-9}),
        (COMP, {"model": m, "prompt": [[1, 2, 3]], "stop": ["\u2603", "\n\n\n"], "logprobs": None, "n": 1}),
    ]
    for path, body in bodies:
        status, _, resp = server.post(path, dict({"max_tokens": CAP}, **body))
        assert status == 200, (body, resp)
    assert server.health()["errors"] == 0


def test_stalled_body_is_dropped_with_408_while_others_are_served(server):
    """Slowloris-style: headers promise 100 bytes, 10 arrive, then nothing. The server answers 408 after
    --body-timeout (2 s here) and serves other clients meanwhile."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        sock.sendall(f"POST {COMP} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                     f"{API_KEY}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"model": ')
        t0 = time.time()
        status, _, body = server.post(COMP, {"model": server.model, "prompt": "Hi", "max_tokens": 2})
        assert status == 200 and time.time() - t0 < BODY_TIMEOUT, "another client waited for the stalled one"
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        waited = time.time() - t0
    finally:
        sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:300]
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    # 408 after the timeout, not long after it (3 s of slack for a loaded 2-core machine)
    assert BODY_TIMEOUT * 0.9 <= waited < BODY_TIMEOUT + 3.0, waited
    assert server.health()["status"] == "ok"


def test_prompts_longer_than_max_prompt_tokens_get_a_400_before_any_decoding():
    """--max-prompt-tokens bounds how long one admission's prefill can hold up every other stream: a longer prompt
    is refused with 400 context_length_exceeded naming the limit; one at the limit is accepted."""
    from blockdraft.serve.schema import APIError, RequestParser

    parser = RequestParser(tokenizer=None, model_name="m", max_context=4096, max_tokens_cap=16, vocab_size=100,
                           max_prompt_tokens=8)
    ok = parser.parse({"model": "m", "prompt": list(range(8)), "max_tokens": 2}, chat=False)
    assert ok.prompt_ids == list(range(8))
    with pytest.raises(APIError) as e:
        parser.parse({"model": "m", "prompt": list(range(9)), "max_tokens": 2}, chat=False)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert "at most 8" in e.value.message and "--max-prompt-tokens" in e.value.message
    unbounded = RequestParser(None, "m", 4096, 16, 100)
    assert len(unbounded.parse({"model": "m", "prompt": list(range(9)) * 50}, chat=False).prompt_ids) == 450
