#!/usr/bin/env python
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

    nice -n 19 .venv/bin/python scripts/soak.py                      # default target, 10 minutes
    .venv/bin/python scripts/soak.py --minutes 0.5 --target DIR --draft DIR --out /tmp/soak   # a quick try

Writes OUT/report.json and OUT/report.md; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
class ServerProcess:
    def __init__(self, args: argparse.Namespace, log_path: Path) -> None:
        cmd = [sys.executable, "-m", "blockdraft.serve.app", "--host", "127.0.0.1", "--port", "0",
               "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
               "--max-tokens-cap", str(args.max_tokens), "--dtype", args.dtype]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.target:
            cmd += ["--target", args.target]
        if args.draft:
            cmd += ["--draft", args.draft]
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline, self.port = time.time() + 600, None
        while time.time() < deadline and self.proc.poll() is None:
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

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

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


def client_loop(i: int, args, port: int, model: str, deadline: float, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.time() < deadline:
        r = rng.random()
        if r < 0.1:
            name, raw = rng.choice(INVALID)
            rec = one_request(port, "/v1/chat/completions", raw.replace(b'"M"', json.dumps(model).encode()),
                              False, False, args.timeout)
            rec["kind"], rec["invalid"] = "invalid", name
        elif r < 0.2:
            body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
                    "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
            rec = one_request(port, "/v1/chat/completions", json.dumps(body).encode(), True, True, args.timeout)
            rec["kind"] = "abandon"
        else:
            stream = rng.random() < 0.5
            path, body = _valid_body(rng, model, args.max_tokens, stream)
            rec = one_request(port, path, json.dumps(body).encode(), stream, False, args.timeout)
            rec["kind"], rec["max_tokens"] = "valid", body["max_tokens"]
        tally.add(rec)


def burst(args, port: int, model: str, tally: Tally, n: int) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Count to five."}],
                       "max_tokens": 16, "temperature": 0}).encode()

    def go():
        rec = one_request(port, "/v1/chat/completions", body, False, False, args.timeout)
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


# ------------------------------------------------------------------------------------------------- report
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def summarize(args, tally: Tally, rss: list[tuple[float, int]], warmup_end: float, end: float, probes: tuple,
              metrics_before: dict, metrics_after: dict, health: dict, exit_code: int | None, wall: float) -> dict:
    recs = tally.records
    statuses = Counter(r["status"] for r in recs)
    four = Counter(f'{r["status"]} {r.get("code")}' for r in recs if r["status"] and 400 <= r["status"] < 500)
    five = sum(n for s, n in statuses.items() if s and s >= 500)
    lost = [r for r in recs if r.get("lost")]
    dup_ids = sum(n - 1 for n in tally.ids.values() if n > 1) + sum(1 for r in recs if r.get("duplicated"))
    ok = [r for r in recs if r["status"] == 200 and not r.get("abandon") and not r.get("lost")]
    over_cap = [r for r in ok if r.get("usage") and r.get("max_tokens")
                and r["usage"]["completion_tokens"] > r["max_tokens"]]
    invalid_not_4xx = [r for r in recs if r["kind"] == "invalid" and not (r["status"] and 400 <= r["status"] < 500)]
    lat = {k: [r["latency"] for r in ok if (r["stream"] if k == "stream" else not r["stream"])]
           for k in ("stream", "non-stream")}

    def med(lo: float, hi: float) -> float | None:
        xs = [b for t, b in rss if lo <= t <= hi]
        return statistics.median(xs) if xs else None

    rss_start, rss_end = med(warmup_end, warmup_end + 60), med(end - 60, end)
    growth = (rss_end - rss_start) / rss_start if rss_start and rss_end else None

    def d(name: str, **labels) -> float:
        key = (f"blockdraft:{name}", tuple(sorted(labels.items())))
        return metrics_after.get(key, 0.0) - metrics_before.get(key, 0.0)

    server_by_status = Counter()
    for (name, labels), v in metrics_after.items():
        lab = dict(labels)
        if name == "blockdraft:http_requests_total" and lab["endpoint"].startswith("/v1/c"):
            server_by_status[lab["status"]] += v - metrics_before.get((name, labels), 0.0)
    client_by_status = Counter(str(r["status"]) for r in recs if r["status"])
    drafts, accepted = d("spec_decode_num_drafts_total"), d("spec_decode_num_accepted_tokens_total")
    checks = {
        "no_5xx": five == 0,
        "none_lost": not lost,
        "none_duplicated": dup_ids == 0,
        "invalid_got_4xx": not invalid_not_4xx,
        "max_tokens_respected": not over_cap,
        "rss_flat": growth is not None and growth <= args.rss_tolerance,
        "probe_identical": probes[0] == probes[1],
        "server_counts_match_clients": {k: v for k, v in server_by_status.items() if v} == dict(client_by_status),
        "server_no_engine_errors": health.get("errors") == 0 and health.get("worker_alive") is True,
        "clean_exit": exit_code in (0, -signal.SIGTERM),
    }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "wall_seconds": round(wall, 1),
        "requests_sent": len(recs),
        "completed_200": len(ok),
        "by_kind": dict(Counter(r["kind"] for r in recs)),
        "status_counts": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "4xx_by_reason": dict(sorted(four.items())),
        "429": statuses.get(429, 0),
        "5xx": five,
        "lost": len(lost),
        "lost_examples": [{k: r.get(k) for k in ("kind", "path", "stream", "status", "exception")} for r in lost[:5]],
        "duplicated": dup_ids,
        "abandoned_streams": sum(1 for r in recs if r["kind"] == "abandon" and r["status"] == 200),
        "server_cancelled": health.get("cancelled"),
        "latency_seconds": {k: {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in lat.items()},
        "generated_tokens": sum(r["usage"]["completion_tokens"] for r in ok if r.get("usage")),
        "rss_mb": {"start": rss_start and round(rss_start / 2**20, 1), "end": rss_end and round(rss_end / 2**20, 1),
                   "max": round(max(b for _, b in rss) / 2**20, 1) if rss else None,
                   "growth_fraction": growth and round(growth, 4),
                   "series": [(round(t - rss[0][0]), round(b / 2**20, 1)) for t, b in rss[::6]]},
        "probe": {"identical": probes[0] == probes[1], "start": probes[0], "end": probes[1]},
        "server_metrics": {"http_by_status": dict(server_by_status), "tau": 1 + accepted / drafts if drafts else None,
                           "acceptance_rate": accepted / d("spec_decode_num_draft_tokens_total")
                           if d("spec_decode_num_draft_tokens_total") else None},
        "server_exit_code": exit_code,
        "checks": checks,
        "passed": all(checks.values()),
    }


def markdown(rep: dict) -> str:
    c = rep["config"]
    lat = rep["latency_seconds"]
    rows = [
        f"# Soak: {c['minutes']} min, {c['concurrency']} clients, max-batch {c['max_batch']}, max-queue "
        f"{c['max_queue']}, target {c['target'] or 'default'}, draft {c['draft'] or 'default'}",
        "", f"Command: `{c['command']}`", "",
        "| figure | value |", "| --- | --- |",
        f"| requests sent | {rep['requests_sent']} ({', '.join(f'{k} {v}' for k, v in rep['by_kind'].items())}) |",
        f"| completed (200, not abandoned) | {rep['completed_200']} |",
        f"| 4xx by reason | {', '.join(f'{k}: {v}' for k, v in rep['4xx_by_reason'].items()) or 'none'} |",
        f"| 429 (bursts above the queue) | {rep['429']} |",
        f"| 5xx | {rep['5xx']} |",
        f"| lost / duplicated | {rep['lost']} / {rep['duplicated']} |",
        f"| streams abandoned by the client / cancelled by the server | {rep['abandoned_streams']} / "
        f"{rep['server_cancelled']} |",
    ]
    for k, v in lat.items():
        if v["n"]:
            rows.append(f"| latency {k} p50 / p99 (s) | {v['p50']:.2f} / {v['p99']:.2f} (n={v['n']}) |")
    r, sm = rep["rss_mb"], rep["server_metrics"]
    rows += [
        f"| server RSS first minute / last minute / max (MB) | {r['start']} / {r['end']} / {r['max']} "
        f"(growth {r['growth_fraction']}) |",
        f"| greedy probe identical at start and end | {rep['probe']['identical']} |",
        f"| tau / acceptance rate (from /metrics) | {sm['tau'] and round(sm['tau'], 3)} / "
        f"{sm['acceptance_rate'] and round(sm['acceptance_rate'], 3)} |",
        "", "Checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in rep["checks"].items()),
        "", f"RSS series (s, MB): {r['series']}", "",
        "Latencies were measured on a shared 2-core machine under `nice -n 19`: they describe this run, not the "
        "server's speed.",
    ]
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--target", default=None, help="default: the packaged SmolLM2-135M-Instruct")
    p.add_argument("--draft", default=None, help="default: the shipped draft")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens asked (also the server's cap)")
    p.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts above the queue limit")
    p.add_argument("--threads", type=int, default=1, help="server torch threads")
    p.add_argument("--timeout", type=float, default=300.0, help="client timeout per request (then: lost)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the first RSS reading counts")
    p.add_argument("--rss-tolerance", type=float, default=0.05, help="allowed RSS growth, first to last minute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "soak"))
    args = p.parse_args(argv)
    args.command = " ".join(["scripts/soak.py", *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    server = ServerProcess(args, out / "server.log")
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
        deadline = t0 + args.minutes * 60
        clients = [threading.Thread(target=client_loop, args=(i, args, server.port, model, deadline, tally))
                   for i in range(args.concurrency)]
        for t in clients:
            t.start()
        next_burst = t0 + min(args.burst_every, args.minutes * 30)
        while time.time() < deadline:
            if time.time() >= next_burst:
                burst(args, server.port, model, tally, args.max_batch + args.max_queue + 6)
                next_burst += args.burst_every
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
    rep = summarize(args, tally, rss, t0 + args.warmup, end, (first, last), metrics_before, metrics_after, health,
                    exit_code, time.time() - t_start)
    (out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    (out / "report.md").write_text(markdown(rep))
    print(markdown(rep))
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
