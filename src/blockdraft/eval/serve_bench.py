"""Serving benchmark over HTTP with the `openai` client: per-request decode speed and aggregate throughput of
`blockdraft serve` at several concurrency levels, against `blockdraft generate`'s engine on the same prompts.

For each method (a name of the decode registry: `ar`, `dflash`, ...; the draft is --draft, default the shipped one)
one real server process is started (`blockdraft serve --method M`, the given --threads). Then, prompt by prompt, the
same greedy request runs once in this process through the engine `blockdraft generate` uses and once through the
server with concurrency 1 (interleaved, so both see the same machine; a plain, non-streaming request, so that the
client sits idle while the server decodes: on a 2-core machine a client parsing a stream takes a core from the
server). Compared: decode tok/s as the engine measures it (tokens committed after the first / decode seconds; the
server's figure is the `blockdraft` object of its answer) and end-to-end tok/s (tokens / seconds from request to
answer, prefill included). After that, for each concurrency c, c client threads stream requests back to back until
max(c, --min-requests) have completed.

Reported per level: total completion tokens / wall seconds, per-request decode tok/s on the client's clock
((completion tokens - 1) / (last chunk - first chunk)), mean time to first token, mean tau, and the server
process's resident memory after the level (VmRSS), its peak so far (VmHWM, which includes loading and pages of mapped
files) and the most anonymous memory it held while loading (RssAnon sampled every 0.2 s: what a machine must have
free to start it).

    blockdraft serve-bench --threads 2 --out benchmarks/serving/DATE/serve.md

Prompts: the bench's math, code and chat tasks (`--n` each), which no draft trained on.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..decode.spec import DecodeSpec, build_engine
from ..models.loading import encode_prompt, load_draft, load_target, resolve_draft
from ..prompts import load_task
from .soak import ServerOptions, ServerProcess  # the soak test's server launcher: same process and readiness probe


@dataclass(frozen=True)
class ServeBenchConfig:
    """`blockdraft serve-bench`: server is the config every method's server starts from (its target, draft, dtype
    and threads are also the in-process engine's; host 127.0.0.1, port 0); each of methods (names of the
    decode registry) gets one server, `ar`'s without a draft. n prompts of each of tasks, max_tokens per answer;
    each concurrency level runs until max(level, min_requests) requests completed; out: also write the markdown
    there (and a .json next to it)."""

    server: ServerOptions
    methods: tuple[str, ...] = ("ar", "dflash")
    tasks: tuple[str, ...] = ("math", "code", "chat")
    n: int = 3
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    min_requests: int = 8
    max_tokens: int = 96
    out: str | None = None


def stream_one(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    chunks, usage, extra = 0, None, {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else now
            last = now
            chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        bd = getattr(chunk, "blockdraft", None) or (chunk.model_extra or {}).get("blockdraft")
        if bd:
            extra = bd
    n = usage.completion_tokens if usage is not None else chunks
    decode = (last - first) if first is not None and last is not None else 0.0
    return {"tokens": n, "latency": time.perf_counter() - t0, "ttft": (first - t0) if first else 0.0,
            "decode_tok_s": (n - 1) / decode if decode > 0 and n > 1 else 0.0, "tau": extra.get("tau")}


def plain_one(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    wall = time.perf_counter() - t0
    bd = (resp.model_extra or {}).get("blockdraft", {})
    n = resp.usage.completion_tokens
    return {"tokens": n, "e2e_tok_s": n / wall, "decode_tok_s": bd.get("decode_tokens_per_s", 0.0),
            "tau": bd.get("tau")}


def level(client, model: str, prompts: list[list[dict]], concurrency: int, n_requests: int, max_tokens: int) -> dict:
    lock = threading.Lock()
    counter = iter(range(n_requests))
    recs: list[dict] = []

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = stream_one(client, model, prompts[i % len(prompts)], max_tokens)
            with lock:
                recs.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    taus = [r["tau"] for r in recs if r["tau"] is not None]
    return {"concurrency": concurrency, "requests": len(recs), "tokens": sum(r["tokens"] for r in recs),
            "wall_s": wall, "tok_per_s": sum(r["tokens"] for r in recs) / wall,
            "decode_tok_s_mean": statistics.mean(r["decode_tok_s"] for r in recs),
            "ttft_mean_s": statistics.mean(r["ttft"] for r in recs), "tau": statistics.mean(taus) if taus else None}


def resident_gb(pid: int) -> dict[str, float | None]:
    """A process's resident memory now (VmRSS) and its peak (VmHWM), GB; None where /proc does not say."""
    out: dict[str, float | None] = {"rss_gb": None, "peak_gb": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss_gb" if key == "VmRSS" else "peak_gb"] = int(value.split()[0]) * 1024 / 1e9
    except OSError:
        pass
    return out


def run(bench: ServeBenchConfig) -> int:
    """`blockdraft serve-bench`: the comparison above, printed as markdown (and written to bench.out)."""
    from openai import OpenAI  # a test dependency, needed only here

    srv = bench.server
    torch.set_num_threads(srv.threads)
    torch.set_grad_enabled(False)
    target, src = load_target(srv.target, srv.dtype)
    prompts = [q for t in bench.tasks for q in load_task(t, n=bench.n, seed=0)]
    messages = [q.messages for q in prompts]
    cfg = GenerationConfig(max_new_tokens=bench.max_tokens)
    draft_path = resolve_draft(srv.draft, src.name)
    draft = load_draft(draft_path, target) if draft_path is not None else None
    rows, solo = [], []
    for method in bench.methods:
        engine = build_engine(target, draft, DecodeSpec(method))
        log = Path(f"/tmp/serve-bench-{method}.log")
        server = ServerProcess(dataclasses.replace(srv, method=method, draft="none" if method == "ar" else srv.draft),
                               log)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
            model = client.models.list().data[0].id
            stream_one(client, model, messages[0], 8)  # warm-up, both sides
            engine.generate(encode_prompt(target.tokenizer, messages[0]), GenerationConfig(max_new_tokens=8))
            for q, msgs in zip(prompts, messages):
                t0 = time.perf_counter()
                res = engine.generate(encode_prompt(target.tokenizer, msgs), cfg)
                wall = time.perf_counter() - t0
                http = plain_one(client, model, msgs, bench.max_tokens)
                solo.append({"method": method, "prompt": q.id, "generate_decode_tok_s": res.stats.decode_tokens_per_s,
                             "generate_e2e_tok_s": len(res.token_ids) / wall, "generate_tau": res.stats.tau,
                             "serve_decode_tok_s": http["decode_tok_s"], "serve_e2e_tok_s": http["e2e_tok_s"],
                             "serve_tau": http["tau"], "tokens": http["tokens"], "same_tokens":
                             http["tokens"] == len(res.token_ids)})
                print(json.dumps(solo[-1]), file=sys.stderr, flush=True)
            for c in bench.concurrency:
                r = level(client, model, messages, c, max(c, bench.min_requests), bench.max_tokens)
                r.update(method=method, **resident_gb(server.proc.pid),
                         start_anon_peak_gb=server.start_anon_peak_bytes / 1e9)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
        finally:
            server.stop()

    lines = [f"target {src.name} ({srv.dtype}, weights {target.weights.describe()}), draft "
             f"{draft_path.name if draft_path else 'none'}, greedy, max_tokens {bench.max_tokens}, threads "
             f"{srv.threads}, {len(prompts)} prompts ({','.join(bench.tasks)}), max_batch {srv.max_batch}", "",
             "Concurrency 1, prompt by prompt (medians; ratios paired per prompt): `blockdraft generate`'s engine "
             "in-process vs the server through HTTP", "",
             "| method | generate decode tok/s | serve decode tok/s | serve / generate | generate e2e tok/s | "
             "serve e2e tok/s | serve / generate (e2e) | tau |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for method in bench.methods:
        s = [x for x in solo if x["method"] == method]

        def med(key: str) -> float:
            return statistics.median(x[key] for x in s)

        def ratio(a: str, b: str) -> float:
            return statistics.median(x[a] / x[b] for x in s if x[b] > 0)

        lines.append(f"| {method} | {med('generate_decode_tok_s'):.1f} | {med('serve_decode_tok_s'):.1f} | "
                     f"{ratio('serve_decode_tok_s', 'generate_decode_tok_s'):.2f}x | {med('generate_e2e_tok_s'):.1f} | "
                     f"{med('serve_e2e_tok_s'):.1f} | {ratio('serve_e2e_tok_s', 'generate_e2e_tok_s'):.2f}x | "
                     f"{statistics.mean(x['generate_tau'] for x in s):.2f} |")
    base = {r["concurrency"]: r["tok_per_s"] for r in rows if r["method"] == "ar"}
    lines += ["", "| method | concurrency | requests | total tok/s | vs ar | per-request decode tok/s | mean TTFT s "
              "| tau | server RSS GB | server peak GB | loading anon peak GB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def gb(v) -> str:
        return "" if v is None else f"{v:.2f}"

    for r in rows:
        vs = f"{r['tok_per_s'] / base[r['concurrency']]:.2f}x" if r["concurrency"] in base else ""
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else ""
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['requests']} | {r['tok_per_s']:.1f} | {vs} | "
                     f"{r['decode_tok_s_mean']:.1f} | {r['ttft_mean_s']:.2f} | {tau} | {gb(r.get('rss_gb'))} | "
                     f"{gb(r.get('peak_gb'))} | {gb(r.get('start_anon_peak_gb'))} |")
    md = "\n".join(lines)
    print(md)
    if bench.out:
        Path(bench.out).parent.mkdir(parents=True, exist_ok=True)
        Path(bench.out).write_text(md + "\n")
        Path(bench.out).with_suffix(".json").write_text(json.dumps({"solo": solo, "levels": rows}, indent=1) + "\n")
    return 0
