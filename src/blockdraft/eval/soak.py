"""Soak test of the HTTP server: start it on loopback, run a bounded mixed load for --minutes, stop by itself, and
report whether it stayed correct. Not part of `make test` (it runs for minutes on the real default target).

Load: --concurrency client threads, each looping until the deadline with a seeded random choice per request:
~10% invalid bodies (expected 4xx), ~10% streams the client abandons after two chunks (the server must free the
row), the rest valid chat / completion requests, streamed or not, with random valid parameters (temperature 0 / 0.7
/ 1, top_p, top_k, seed, stop, max_tokens) and concurrent faults: ~5% temperatures of 1e-40 or 5e-5, ~5%
max_tokens 1, ~3% prompts of ~1,500 tokens. Every --burst-every seconds a burst of max_batch + max_queue + 6
simultaneous requests goes above the queue limit (the excess must get 429 with Retry-After).

Checks, all in the report: 5xx == 0; lost == 0 (a request with no complete answer: connection error, timeout, a
stream without exactly one finish chunk and one [DONE]); duplicated == 0 (a response id seen twice, or a stream
whose chunks carry two ids); server RSS flat (median of the last minute within --rss-tolerance of the median of the
first minute after warm-up); the greedy answer to a fixed probe prompt identical at start and end; the server's own
counters (/metrics) equal to what the clients saw.

    nice -n 19 blockdraft soak                                       # default target, 10 minutes
    blockdraft soak --minutes 0.5 --target DIR --draft DIR --out /tmp/soak   # a quick try

Writes OUT/report.json and OUT/report.md; exits 1 if a check failed.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .soak_report import markdown, summarize

PROMPTS = [
    "What is 17 times 23? Show your steps.",
    "Write a Python function that reverses a string.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash map is in two sentences.",
    "Write a short poem about autumn leaves.",
    "What is the capital of Australia?",
]
PROBE = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many " \
        "clips did Natalia sell altogether in April and May?"
INVALID = [  # (name, raw body): each must get a 4xx with an OpenAI-style error
    ("bad json", b"{not json"),
    ("deep nesting", b'{"model": "m", "messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"),
    ("wrong type", b'{"model": "M", "messages": [{"role": "user", "content": 5}]}'),
    ("unknown field", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}'),
    ("NaN", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("unsupported", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}'),
    ("unknown model", b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}'),
    ("too long", b'{"model": "M", "messages": [{"role": "user", "content": "' + b"word " * 9000 + b'"}]}'),
]


# ------------------------------------------------------------------------------------------------- server
class ServerOptions(Protocol):
    """What the soak test and the serving benchmark read of the server's typed config (`serve.config.ServeConfig`,
    made by the CLI): eval talks to a server through its command line and HTTP only, so it does not import serve."""

    target: str | None
    draft: str | None
    dtype: str
    method: str
    host: str
    port: int
    max_batch: int
    max_queue: int
    max_tokens_cap: int
    threads: int | None

    def argv(self) -> list[str]: ...


@dataclass(frozen=True)
class SoakConfig:
    """`blockdraft soak`: server is the server under test (host 127.0.0.1, port 0: a free loopback port; its
    max_batch, max_queue and max_tokens_cap also shape the load); the load runs for minutes with concurrency client
    threads, a burst above the queue limit every burst_every seconds, timeout seconds per request (then: lost), RSS
    readings counted after warmup seconds and allowed to grow by rss_tolerance; command: the command line, recorded
    in the report."""

    server: ServerOptions
    minutes: float = 10.0
    concurrency: int = 6
    burst_every: float = 60.0
    timeout: float = 300.0
    warmup: float = 30.0
    rss_tolerance: float = 0.05
    seed: int = 0
    out: str = "benchmarks/soak"
    command: str = ""


class ServerProcess:
    def __init__(self, server: ServerOptions, log_path: Path) -> None:
        """A `blockdraft serve` process started with the flags of server's config (`argv`), which must ask for a
        free loopback port (host 127.0.0.1, port 0)."""
        if server.host != "127.0.0.1" or server.port != 0:
            raise ValueError(f"a server process listens on a free loopback port (host 127.0.0.1, port 0), not "
                             f"{server.host}:{server.port}")
        cmd = [sys.executable, "-m", "blockdraft.cli", "serve", *server.argv()]
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline, self.port = time.time() + 600, None
        # the most anonymous memory seen while it loads, sampled every 0.2 s: what a machine must have free (the
        # peak the kernel keeps, VmHWM, also counts pages of mapped files, which it can drop)
        self.start_anon_peak_bytes = 0
        while time.time() < deadline and self.proc.poll() is None:
            self.start_anon_peak_bytes = max(self.start_anon_peak_bytes, self._status_bytes("RssAnon"))
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.2)
        while self.port and time.time() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start:\n" + log_path.read_text()[-3000:])

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 300.0):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace"), dict(resp.getheaders())
        finally:
            conn.close()

    def _status_bytes(self, key: str) -> int:
        """A size line of the process's /proc status (VmRSS, RssAnon, ...) in bytes; 0 where it has none."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def rss_bytes(self) -> int:
        return self._status_bytes("VmRSS")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


# ------------------------------------------------------------------------------------------------ clients
class Tally:
    """Everything the clients saw; one lock, appended from all client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.ids: Counter = Counter()

    def add(self, rec: dict) -> None:
        with self.lock:
            self.records.append(rec)
            if rec.get("id"):
                self.ids[rec["id"]] += 1


def _valid_body(rng: random.Random, model: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    chat = rng.random() < 0.6
    body: dict = {"model": model, "max_tokens": rng.randint(1, max_tokens), "stream": stream}
    t = rng.choice([0, 0, 0.7, 1.0])
    fault = rng.random()
    if fault < 0.05:  # a temperature that overflows a division (decoded greedily below 1e-4)
        t = rng.choice([1e-40, 5e-5])
    elif fault < 0.10:  # a row that finishes in its admission step, beside rows that decode
        body["max_tokens"] = 1
    body["temperature"] = t
    if t:
        body["seed"] = rng.randrange(1 << 31)
        if rng.random() < 0.5:
            body["top_p"] = rng.choice([0.8, 0.95, 1.0])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([5, 40])
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n\n", ["."], [" the", "\n"]])
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    prompt = rng.choice(PROMPTS)
    if rng.random() < 0.03:  # a long prompt (~1,500 tokens), prefilled chunk by chunk beside the live streams
        prompt = " ".join([prompt] * max(1, 6000 // max(1, len(prompt))))[:6000]
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _read_stream(resp) -> dict:
    """Read an SSE answer to its end: the ids seen, finish chunks, [DONE] markers, error events."""
    ids, finishes, done, errors, usage = set(), 0, 0, 0, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done += 1
            continue
        ev = json.loads(data)
        if "error" in ev:
            errors += 1
            continue
        ids.add(ev["id"])
        finishes += sum(1 for c in ev["choices"] if c.get("finish_reason"))
        usage = ev.get("usage") or usage
    return {"ids": ids, "finishes": finishes, "done": done, "errors": errors, "usage": usage}


def one_request(port: int, path: str, body: bytes, stream: bool, abandon: bool, timeout: float) -> dict:
    rec: dict = {"path": path, "stream": stream, "abandon": abandon}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            payload = json.loads(resp.read())
            rec["code"] = payload["error"]["code"]
            rec["retry_after"] = resp.getheader("Retry-After")
        elif abandon:
            chunks = 0
            while chunks < 2:
                line = resp.readline()
                if not line:
                    break
                chunks += line.startswith(b"data: ")
            rec["abandoned_after"] = chunks
            resp.close()
        elif stream:
            s = _read_stream(resp)
            rec["id"] = next(iter(s["ids"])) if len(s["ids"]) == 1 else None
            rec["lost"] = s["finishes"] != 1 or s["done"] != 1 or s["errors"] > 0
            rec["duplicated"] = len(s["ids"]) > 1
            rec["usage"] = s["usage"]
        else:
            payload = json.loads(resp.read())
            rec["id"] = payload["id"]
            rec["usage"] = payload["usage"]
            rec["lost"] = payload["choices"][0]["finish_reason"] not in ("stop", "length")
    except (OSError, http.client.HTTPException, json.JSONDecodeError, KeyError) as e:
        rec["status"], rec["lost"], rec["exception"] = None, True, f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    rec["latency"] = time.perf_counter() - t0
    return rec


def client_loop(i: int, cfg: SoakConfig, port: int, model: str, deadline: float, tally: Tally) -> None:
    max_tokens, timeout = cfg.server.max_tokens_cap, cfg.timeout
    rng = random.Random(cfg.seed * 1000 + i)
    while time.time() < deadline:
        r = rng.random()
        if r < 0.1:
            name, raw = rng.choice(INVALID)
            rec = one_request(port, "/v1/chat/completions", raw.replace(b'"M"', json.dumps(model).encode()),
                              False, False, timeout)
            rec["kind"], rec["invalid"] = "invalid", name
        elif r < 0.2:
            body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            rec = one_request(port, "/v1/chat/completions", json.dumps(body).encode(), True, True, timeout)
            rec["kind"] = "abandon"
        else:
            stream = rng.random() < 0.5
            path, body = _valid_body(rng, model, max_tokens, stream)
            rec = one_request(port, path, json.dumps(body).encode(), stream, False, timeout)
            rec["kind"], rec["max_tokens"] = "valid", body["max_tokens"]
        tally.add(rec)


def burst(timeout: float, port: int, model: str, tally: Tally, n: int) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Count to five."}],
                       "max_tokens": 16, "temperature": 0}).encode()

    def go():
        rec = one_request(port, "/v1/chat/completions", body, False, False, timeout)
        rec["kind"] = "burst"
        tally.add(rec)

    threads = [threading.Thread(target=go) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def probe(server: ServerProcess, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROBE}], "max_tokens": 48,
                       "temperature": 0}).encode()
    status, text, _ = server.request("POST", "/v1/chat/completions", body)
    if status != 200:
        raise RuntimeError(f"probe failed: {status} {text[:300]}")
    return json.loads(text)["choices"][0]["message"]["content"]


def scrape(server: ServerProcess) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    _, text, _ = server.request("GET", "/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# --------------------------------------------------------------------------------------------------- main
def run(cfg: SoakConfig) -> int:
    """`blockdraft soak`: run the load (see above), write OUT/report.json and OUT/report.md; 1 if a check failed."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    server = ServerProcess(cfg.server, out / "server.log")
    exit_code = None
    try:
        model = json.loads(server.request("GET", "/v1/models")[1])["data"][0]["id"]
        first = probe(server, model)
        metrics_before = scrape(server)
        rss: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample_rss():
            while not stop.is_set():
                rss.append((time.time(), server.rss_bytes()))
                stop.wait(5.0)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        tally = Tally()
        t0 = time.time()
        deadline = t0 + cfg.minutes * 60
        clients = [threading.Thread(target=client_loop, args=(i, cfg, server.port, model, deadline, tally))
                   for i in range(cfg.concurrency)]
        for t in clients:
            t.start()
        next_burst = t0 + min(cfg.burst_every, cfg.minutes * 30)
        while time.time() < deadline:
            if time.time() >= next_burst:
                burst(cfg.timeout, server.port, model, tally, cfg.server.max_batch + cfg.server.max_queue + 6)
                next_burst += cfg.burst_every
            time.sleep(0.5)
        for t in clients:
            t.join()
        end = time.time()
        stop.set()
        sampler.join()
        health = json.loads(server.request("GET", "/health")[1])
        deadline_idle = time.time() + 30
        while (health["active"] or health["queued"]) and time.time() < deadline_idle:
            time.sleep(0.2)
            health = json.loads(server.request("GET", "/health")[1])
        metrics_after = scrape(server)  # before the last probe: the counters compare with the clients' load alone
        last = probe(server, model)
    finally:
        exit_code = server.stop()
    rep = summarize(cfg, tally, rss, t0 + cfg.warmup, end, (first, last), metrics_before, metrics_after, health,
                    exit_code, time.time() - t_start)
    (out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    (out / "report.md").write_text(markdown(rep))
    print(markdown(rep))
    return 0 if rep["passed"] else 1
