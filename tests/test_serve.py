"""The OpenAI-compatible server end to end: a real server process on a free loopback port, the real `openai`
client, raw HTTP for what a client library hides (malformed bodies, disconnects, headers).

The target is a tiny random LLaMA saved with the real SmolLM2 tokenizer (as in test_cli), with a tiny untrained
DFlash draft; the server runs with a small per-step delay so that requests stay in flight long enough to fill the
queue and to be cancelled."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from serve_helpers import API_KEY, Server, tiny_model_dir

openai = pytest.importorskip("openai")

MAX_BATCH, MAX_QUEUE, CAP = 4, 4, 64
PROMPTS = ["Hi", "Tell me a story about a cat.", "What is 2+2?", "List three colours, please, in order of preference."]


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    target_dir, draft_dir = tiny_model_dir(out)
    srv = Server(["--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "fp32", "--api-key", API_KEY,
                  "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--max-tokens-cap", str(CAP),
                  "--max-body-bytes", "65536", "--debug-step-delay", "0.02"], out / "server.log")
    srv.model = target_dir.name
    yield srv
    srv.stop()
    log = (out / "server.log").read_text()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: exit status 0 or -SIGTERM
    assert srv.proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in log, log[-3000:]


def _chat(srv, prompt: str, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": prompt}], **kw)


def _stream_text(stream, chat: bool = True):
    parts, finish, extra, usage = [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if getattr(chunk, "model_extra", None) and "blockdraft" in chunk.model_extra:
            extra = chunk.model_extra["blockdraft"]
        for c in chunk.choices:
            piece = c.delta.content if chat else c.text
            parts.append(piece or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish, usage, extra


# -------------------------------------------------------------------------------------------------- tests
def test_models_health_and_auth(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    h = server.health()
    assert h["status"] == "ok" and h["max_batch"] == MAX_BATCH and h["max_queue"] == MAX_QUEUE
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="nope").chat.completions.create(model=server.model, messages=[
            {"role": "user", "content": "Hi"}])
    status, headers, body = server.post("/v1/completions", {"model": server.model, "prompt": "x"}, auth=False)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_chat_and_completion_report_usage_and_acceptance(server):
    r = _chat(server, PROMPTS[1])
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.model == server.model and r.choices[0].message.role == "assistant"
    assert isinstance(text, str) and text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    bd = r.model_extra["blockdraft"]
    assert bd["tau"] >= 1.0 and bd["target_forwards"] >= 1 and bd["draft"] == "tiny-draft"
    assert sum(bd["accept_lengths"]) + 1 == r.usage.completion_tokens
    c = server.client().completions.create(model=server.model, prompt="Once upon a time", max_tokens=12,
                                           temperature=0)
    assert c.object == "text_completion" and c.choices[0].text and c.usage.completion_tokens <= 12
    # max_tokens is capped to the server's limit (ignore_eos is an extension: a fixed length)
    capped = server.client().completions.create(model=server.model, prompt="a", max_tokens=10_000, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == CAP and capped.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming(server):
    for prompt in PROMPTS[:2]:
        full = _chat(server, prompt).choices[0].message.content
        text, finish, usage, extra = _stream_text(_chat(server, prompt, stream=True,
                                                        stream_options={"include_usage": True}))
        assert text == full and finish in ("stop", "length")
        assert usage is not None and usage.completion_tokens >= 1 and extra["tau"] >= 1.0
    cl = server.client()
    kw = dict(model=server.model, prompt="The weather today", max_tokens=20, temperature=0)
    full = cl.completions.create(**kw).choices[0].text
    text, finish, _, _ = _stream_text(cl.completions.create(stream=True, **kw), chat=False)
    assert text == full
    # raw SSE framing: data lines, OpenAI chunk objects, a final [DONE]
    status, headers, body = server.post("/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
        "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_stop_sequences(server):
    cl = server.client()
    kw = dict(model=server.model, prompt="Start:", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = cl.completions.create(**kw).choices[0].text
    assert len(full) > 30
    stop = full[12:16]
    expected = full[: full.find(stop)]
    r = cl.completions.create(stop=[stop, "\u2603never"], **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    text, finish, _, _ = _stream_text(cl.completions.create(stop=stop, stream=True, **kw), chat=False)
    assert text == expected and finish == "stop"


def test_errors_are_openai_shaped(server):
    cl = server.client()
    m = server.model
    msgs = [{"role": "user", "content": "Hi"}]
    for bad in (dict(n=2), dict(logprobs=True), dict(presence_penalty=0.5),
                dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])):
        with pytest.raises(openai.BadRequestError) as e:
            cl.chat.completions.create(model=m, messages=msgs, **bad)
        assert e.value.status_code == 400 and e.value.body["code"] == "unsupported_parameter", bad
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        cl.chat.completions.create(model=m, messages=msgs, extra_body={"frobnicate": 1})
    # neutral values of unsupported parameters are fine; top_k is an extension
    ok = cl.chat.completions.create(model=m, messages=msgs, n=1, logprobs=False, presence_penalty=0, max_tokens=3,
                                    temperature=0.7, top_p=0.9, seed=3, extra_body={"top_k": 5})
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        cl.chat.completions.create(model=m, messages=[{"role": "user", "content": "word " * 200}])
    assert e.value.body["code"] == "context_length_exceeded" and "context length" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        cl.chat.completions.create(model="gpt-4", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        cl.chat.completions.create(model=m, messages=msgs, temperature="hot")
    for raw in (b"{not json", b"[1, 2]", b'{"model": "' + m.encode() + b'", "messages": "hello"}'):
        status, _, body = server.post("/v1/chat/completions", raw=raw)
        assert status in (400, 422) and set(body["error"]) == {"message", "type", "param", "code"}, raw
    status, _, body = server.post("/v1/completions", {"model": m, "prompt": "x" * 70_000})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, _, body = server.post("/v1/completions", {"model": m, "prompt": ["a", "b"]})
    assert status == 400
    status, _, body = server.request("GET", "/v1/nothing-here")
    assert status == 404 and "error" in body
    assert server.health()["status"] == "ok"


def test_concurrent_greedy_requests_equal_their_solo_outputs(server):
    server.wait_idle()
    solo = [_chat(server, p).choices[0].message.content for p in PROMPTS]
    out: dict[int, str] = {}

    def go(i):
        out[i] = _chat(server, PROMPTS[i]).choices[0].message.content

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [out[i] for i in range(len(PROMPTS))] == solo


def test_full_queue_is_429_with_retry_after(server):
    server.wait_idle()
    statuses, headers = [], []
    lock = threading.Lock()

    def go():
        s, h, b = server.post("/v1/completions", {"model": server.model, "prompt": "count", "max_tokens": 40,
                                                  "temperature": 0, "ignore_eos": True})
        with lock:
            statuses.append(s)
            headers.append((h, b))

    threads = [threading.Thread(target=go) for _ in range(MAX_BATCH + MAX_QUEUE + 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(statuses) == MAX_BATCH + MAX_QUEUE + 4
    assert statuses.count(200) >= MAX_BATCH + MAX_QUEUE and 429 in statuses, statuses
    for s, (h, b) in zip(statuses, headers):
        if s == 429:
            assert int(h["retry-after"]) >= 1 and b["error"]["type"] == "rate_limit_error"
        else:
            assert b["usage"]["completion_tokens"] == 40
    assert server.health()["rejected"] >= 1


def _open_stream(srv, body: dict):
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_client_disconnect_frees_its_row(server):
    before = server.wait_idle()
    body = {"model": server.model, "messages": [{"role": "user", "content": "Go"}], "max_tokens": CAP,
            "temperature": 0, "ignore_eos": True, "stream": True}
    # streaming: read the first content chunk, then hang up
    sock = _open_stream(server, body)
    buf = b""
    while buf.count(b"data: ") < 3:
        buf += sock.recv(4096)
    assert server.health()["active"] == 1
    t0 = time.time()
    sock.close()
    h = server.wait_idle(timeout=5)
    assert time.time() - t0 < CAP * 0.02, "freed well before the request would have finished"
    assert h["cancelled"] == before["cancelled"] + 1 and h["completed"] == before["completed"]
    # non-streaming: hang up while it is decoding
    sock = _open_stream(server, dict(body, stream=False))
    deadline = time.time() + 10
    while server.health()["active"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    sock.close()
    h = server.wait_idle(timeout=5)
    assert h["cancelled"] == before["cancelled"] + 2 and h["completed"] == before["completed"]


def test_bounded_load_every_request_is_answered_once(server):
    server.wait_idle()
    solo = {p: _chat(server, p, max_tokens=16).choices[0].message.content for p in PROMPTS}
    n_clients = 12
    results: dict[int, tuple] = {}
    lock = threading.Lock()

    def go(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            if i % 2:
                text, finish, _, _ = _stream_text(_chat(server, prompt, max_tokens=16, stream=True))
                rid = None
            else:
                r = _chat(server, prompt, max_tokens=16)
                text, rid = r.choices[0].message.content, r.id
            outcome = ("ok", text == solo[prompt], rid)
        except openai.RateLimitError as e:
            outcome = ("429", e.status_code == 429 and e.response.headers.get("retry-after") is not None, None)
        except Exception as e:  # noqa: BLE001 - anything else is a failure, recorded for the assertion
            outcome = ("error", repr(e), None)
        with lock:
            assert i not in results
            results[i] = outcome

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(n_clients)), "every client got exactly one answer"
    assert all(kind in ("ok", "429") and good is True for kind, good, _ in results.values()), results
    assert sum(kind == "ok" for kind, _, _ in results.values()) >= MAX_BATCH + MAX_QUEUE
    ids = [rid for _, _, rid in results.values() if rid]
    assert len(ids) == len(set(ids))
    h = server.wait_idle()
    assert h["status"] == "ok" and h["worker_alive"] and h["errors"] == 0


def _scrape(srv) -> dict[tuple, float]:
    """/metrics parsed by prometheus_client's own text parser: {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, text = srv.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_the_requests_sent(server):
    server.wait_idle()
    before = _scrape(server)
    cl, m = server.client(), server.model
    usages, extras = [], []
    for prompt in PROMPTS[:3]:
        r = _chat(server, prompt, max_tokens=12)
        usages.append(r.usage)
        extras.append(r.model_extra["blockdraft"])
    _, _, usage, extra = _stream_text(_chat(server, PROMPTS[3], max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    usages.append(usage)
    extras.append(extra)
    for prompt in ("Once upon a time", "1, 2, 3,"):
        r = cl.completions.create(model=m, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        usages.append(r.usage)
        extras.append(r.model_extra["blockdraft"])
    assert server.post("/v1/chat/completions", {"model": m, "messages": "hello"})[0] == 400
    assert server.post("/v1/completions", {"model": m, "prompt": "x"}, auth=False)[0] == 401
    server.wait_idle()
    after = _scrape(server)

    def delta(name: str, **labels) -> float:
        key = (f"blockdraft:{name}", tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("http_requests_total", endpoint="/v1/chat/completions", status="200") == 4
    assert delta("http_requests_total", endpoint="/v1/completions", status="200") == 2
    assert delta("http_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert delta("http_requests_total", endpoint="/v1/completions", status="401") == 1
    finished = sum(delta("request_success_total", finished_reason=r) for r in ("stop", "length", "cancelled"))
    assert finished == 6 and delta("request_success_total", finished_reason="error") == 0
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    # accept_lengths holds a + 1 per verify step (a accepted drafts plus the target's bonus/recovered token)
    steps = sum(len(e["accept_lengths"]) for e in extras)
    accepted = sum(sum(e["accept_lengths"]) - len(e["accept_lengths"]) for e in extras)
    assert delta("spec_decode_num_drafts_total") == steps > 0
    assert delta("spec_decode_num_accepted_tokens_total") == accepted
    per_pos = [delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(16)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)  # position i needs 0..i-1 accepted
    assert delta("spec_decode_num_draft_tokens_total") >= accepted
    assert delta("time_to_first_token_seconds_count") == 6 == delta("e2e_request_latency_seconds_count")
    assert delta("time_per_output_token_seconds_count") == sum(u.completion_tokens > 1 for u in usages)
    assert delta("time_to_first_token_seconds_sum") > 0
    assert after[("blockdraft:num_requests_running", ())] == 0 == after[("blockdraft:num_requests_waiting", ())]


@pytest.mark.slow
def test_default_target_server(tmp_path):
    """The real SmolLM2 target (and its shipped draft when there is one) behind the server."""
    srv = Server(["--dtype", "fp32", "--max-batch", "4", "--max-tokens-cap", "48"], tmp_path / "server.log",
                 timeout=600)
    try:
        srv.model = srv.client().models.list().data[0].id
        assert srv.model == "smollm2-135m-instruct"
        prompts = ["What is 17 times 23?", "Write a haiku about the sea.", "Name the capital of France."]
        solo = [_chat(srv, p, max_tokens=48).choices[0].message.content for p in prompts]
        assert all(s.strip() for s in solo)
        text, _, _, extra = _stream_text(_chat(srv, prompts[0], max_tokens=48, stream=True))
        assert text == solo[0] and extra["tau"] >= 1.0
        out: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(
            i, _chat(srv, prompts[i], max_tokens=48).choices[0].message.content)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [out[i] for i in range(len(prompts))] == solo
    finally:
        srv.stop()


# ------------------------------------------------------------------------------- the scheduler, in-process
def test_scheduler_queue_limit_cancellation_and_worker_recovery(one_thread):
    from conftest import ToyTokenizer, tiny_llama

    from blockdraft.decode.engine import Engine
    from blockdraft.config import GenerationConfig, SamplingParams
    from blockdraft.decode.proposers import NoDraft
    from blockdraft.serve.scheduler import QueueFullError, Scheduler
    from blockdraft.models.target import TargetModel

    target = TargetModel(tiny_llama(), ToyTokenizer())
    boom = {"on": False}

    class Flaky(NoDraft):
        def propose(self, tokens, num_draft, sampling, generator):
            if boom["on"]:
                raise RuntimeError("draft exploded")
            return super().propose(tokens, num_draft, sampling, generator)

    sched = Scheduler(Engine(target, Flaky(), max_batch=1), max_queue=1, step_delay=0.005)
    sched.start()
    try:
        cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True, stop_strings=("zz9",))
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        a = sched.submit(prompts[0], cfg, SamplingParams())
        b = sched.submit(prompts[1], cfg, SamplingParams())
        with pytest.raises(QueueFullError) as e:
            sched.submit(prompts[1], cfg, SamplingParams())
        assert e.value.retry_after >= 1
        sched.cancel(b)  # still queued: dropped at once
        assert b.wait(5).finish_reason == "cancelled"
        text = "".join(a)
        solo = Engine(target).generate(prompts[0], cfg)
        assert a.result.token_ids == solo.token_ids and text == solo.text
        boom["on"] = True  # an engine failure fails the requests in flight, not the worker
        c = sched.submit(prompts[1], cfg, SamplingParams())
        with pytest.raises(RuntimeError, match="draft exploded"):
            c.wait(10)
        boom["on"] = False
        d = sched.submit(prompts[1], cfg, SamplingParams())
        assert d.wait(10).token_ids == Engine(target).generate(prompts[1], cfg).token_ids
        m = sched.metrics()
        assert m["worker_alive"] and m["errors"] == 1 and m["cancelled"] == 1 and m["rejected"] == 1
    finally:
        sched.stop()


def test_a_stream_beside_tiny_temperatures_and_one_token_requests_ends_with_its_solo_text(server):
    """70 requests with temperature 1e-40 or max_tokens 1 sent while one greedy stream decodes: none gets a 5xx,
    the stream's text equals what it gets alone, and afterwards nothing is left active or queued (no slot leaked:
    a normal request is then served)."""
    server.wait_idle()
    prompt = "Tell me a story about a cat."
    solo = _chat(server, prompt, max_tokens=CAP).choices[0].message.content
    result: dict = {}

    def stream():
        s = server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=CAP, temperature=0, stream=True)
        result["text"] = _stream_text(s)[0]

    t = threading.Thread(target=stream)
    t.start()
    statuses = []
    for i in range(70):
        body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
        body.update({"temperature": 1e-40, "max_tokens": 4} if i % 2 else {"max_tokens": 1, "temperature": 0.7})
        statuses.append(server.post("/v1/chat/completions", body)[0])
    t.join(120)
    assert statuses.count(200) == 70, sorted(set(statuses))
    assert result["text"] == solo
    h = server.wait_idle()
    assert h["active"] == 0 and h["queued"] == 0
    assert _chat(server, PROMPTS[0]).choices[0].finish_reason in ("stop", "length")
