"""llama.cpp's own server as a bench reference: `llama-server` on a loopback port, plain or with one of our DFlash
drafts exported to GGUF (`--spec-type draft-dflash`).

The tools come from `make llamacpp` (the llama.cpp tree vendored by the pinned llama-cpp-python sdist, built with
ggml's AMX kernels compiled out) in `tools_dir()`. A server is started once per (model, draft) and serves every
prompt of the run, so model loading and llama.cpp's own warm-up never enter a measurement; the bench adds its usual
untimed warm-up generation on top.

Figures are llama.cpp's own: decode tokens/s from the response's `timings` (tokens after the first over the time
after the first, the bench's definition), and the drafting counters from its Prometheus endpoint read before and
after each request (drafted tokens, accepted tokens, verify steps). Its mean acceptance length
1 + accepted / verify steps is the bench's tau; the counters are flushed when the request's slot is released,
which the server does before it serves the next (metrics) request.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..config import cache_dir
from ..decode.spec import REFERENCES
from ..export.gguf import cached_gguf

SERVER = "llama-server"
_COUNTERS = {  # Prometheus names (tools/server/server-task.cpp) -> record fields
    "llamacpp:spec_decode_num_draft_tokens_total": "drafted",
    "llamacpp:spec_decode_num_accepted_tokens_total": "accepted",
    "llamacpp:spec_decode_num_drafts_total": "verify_steps",
}


def tools_dir() -> Path:
    """Where `make llamacpp` puts the llama.cpp binaries: $BLOCKDRAFT_LLAMACPP_BIN, else <cache dir>/llama.cpp/bin."""
    env = os.environ.get("BLOCKDRAFT_LLAMACPP_BIN")
    return Path(env) if env else cache_dir() / "llama.cpp" / "bin"


def find_tool(name: str) -> Path | None:
    p = tools_dir() / name
    return p if p.is_file() and os.access(p, os.X_OK) else None


def server_missing() -> str | None:
    """None if llama-server is built, else why not and how to build it."""
    if find_tool(SERVER) is None:
        return (f"{SERVER} not found in {tools_dir()} (build llama.cpp's tools with `make llamacpp`, or point "
                f"BLOCKDRAFT_LLAMACPP_BIN at a folder holding them)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """The llama-server process died while answering (a crash inside llama.cpp); the message ends with its log."""


class LlamaServer:
    """One `llama-server` process on 127.0.0.1 with one slot. draft: a DFlash GGUF (then `draft_n` tokens are
    drafted per step). Flash attention is off, as in llama-cpp-python's default, so that the plain `llamacpp`
    methods and this server run the same attention kernels and their greedy outputs are comparable."""

    def __init__(self, model: str | Path, threads: int, ctx: int, draft: str | Path | None = None,
                 draft_n: int | None = None, start_timeout: float = 180.0, spec_type: str = "draft-dflash") -> None:
        exe = find_tool(SERVER)
        if exe is None:
            raise FileNotFoundError(server_missing())
        self.model, self.draft = Path(model), Path(draft) if draft is not None else None
        self.port = _free_port()
        cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-c", str(ctx), "-np", "1", "-fa", "off", "--metrics", "--no-webui"]
        if draft is not None:
            if spec_type not in ("draft-dflash", "draft-simple"):
                raise ValueError(f"spec_type must be draft-dflash or draft-simple, got {spec_type!r}")
            if draft_n is not None and draft_n < 1:
                raise ValueError(f"draft_n must be >= 1 with a draft, got {draft_n}")
            if draft_n is None and spec_type == "draft-dflash":
                raise ValueError("a DFlash draft needs draft_n (its block - 1)")
            # draft-simple: classic speculative decoding with a small model of the target's family; draft_n None
            # keeps llama.cpp's own defaults (what a user gets from `-md` alone)
            cmd += ["-md", str(draft), "--spec-type", spec_type]
            if draft_n is not None:
                cmd += ["--spec-draft-n-max", str(draft_n), "--spec-draft-n-min", "0"]
        self.cmd = cmd
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        atexit.register(self.close)  # no orphaned server when the caller dies before closing it
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    # --------------------------------------------------------------------------------------------- process
    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _wait_ready(self, timeout: float) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{SERVER} exited with code {self.proc.returncode} while loading "
                                   f"{self.model.name}{' + ' + self.draft.name if self.draft else ''}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{SERVER} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- requests
    def counters(self) -> dict[str, float]:
        """llama.cpp's cumulative drafting counters (drafted, accepted, verify_steps)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {v: 0.0 for v in _COUNTERS.values()}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in _COUNTERS:
                out[_COUNTERS[parts[0]]] = float(parts[1])
        return out

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
        """POST /completion with prompt token ids (no chat template, no prompt cache) -> the response JSON with
        `tokens` (the generated ids)."""
        body = {"prompt": list(map(int, ids)), "n_predict": int(max_new_tokens), "cache_prompt": False,
                "return_tokens": True, "stream": False, "seed": int(seed), "temperature": float(temperature),
                "top_k": 0 if temperature > 0 else 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{SERVER} answered {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError) as e:
            try:
                self.proc.wait(timeout=5)  # a crash closes the connection a moment before the process is reaped
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{SERVER} dropped a request ({type(e).__name__}: {e})") from None
            raise ServerExited(f"{SERVER} exited with code {self.proc.returncode} during a request on "
                               f"{self.model.name}{' + ' + self.draft.name if self.draft else ''}:\n"
                               f"{self.log_tail(80)}") from None


class ServerRunner:
    """A bench method on a `LlamaServer`: .run(ids, max_new_tokens, temperature, seed, eos, tok) -> a bench record
    (the fields of the engine's records, plus llama.cpp's drafting counters under `llamacpp`)."""

    def __init__(self, server: LlamaServer) -> None:
        self.server = server

    def close(self) -> None:
        self.server.close()

    def run(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int, eos, tok) -> dict:
        srv = self.server
        before = srv.counters() if srv.draft is not None else None
        t0 = time.perf_counter()
        res = srv.complete(ids, max_new_tokens, temperature, seed)
        e2e = time.perf_counter() - t0
        new = [int(t) for t in res.get("tokens") or []]
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        if stop is not None:
            del new[stop + 1:]
        tm = res.get("timings") or {}
        n_gen, gen_ms = tm.get("predicted_n"), tm.get("predicted_ms")
        tps = (n_gen - 1) / (gen_ms / 1e3) if n_gen and n_gen > 1 and gen_ms else None
        spec = None
        tau = None
        if before is not None:
            after = srv.counters()
            spec = {k: int(after[k] - before[k]) for k in after}
            tau = 1 + spec["accepted"] / spec["verify_steps"] if spec["verify_steps"] else None
        return {"token_ids": new, "text": tok.decode(new, skip_special_tokens=True) if tok is not None else "",
                "finish_reason": "stop" if stop is not None else "length", "prompt_tokens": len(ids),
                "new_tokens": len(new), "tau": tau, "accept_lengths": None, "position_accepted": None,
                "position_trials": None, "target_forwards": None, "decode_tokens_per_s": tps, "e2e_seconds": e2e,
                "prefill_seconds": (tm.get("prompt_ms") or 0) / 1e3 or None,
                "decode_seconds": gen_ms / 1e3 if gen_ms else None, "draft_seconds": None, "verify_seconds": None,
                "llamacpp": spec}


# ------------------------------------------------------------------------------------------ the bench's methods
# The server's methods are the `REFERENCES` of the decode registry run by "llamacpp-server": plain (llama.cpp at
# its fastest, no Python bindings per token) and with our DFlash draft, on the target's own GGUF and on its bf16
# export, and llama.cpp's classic speculative decoding with a smaller model of the target's family as the draft
# model (`-md`) at llama.cpp's default draft settings and at a chosen draft length.


def default_draft_n(draft_dir: str | Path) -> int:
    """Tokens drafted per step: the draft's recommended decode block minus its anchor token (config.json's
    blockdraft.decode_block_size), else its trained block minus one (llama.cpp's own cap)."""
    d = json.loads((Path(draft_dir) / "config.json").read_text())
    dc = d.get("dflash_config") or {}
    block = (d.get("blockdraft") or {}).get("decode_block_size") or dc.get("block_size") or d.get("block_size", 16)
    return max(1, int(block) - 1)


def bf16_gguf(target: str | None, given: str | None) -> Path:
    """The bf16 GGUF of the target: `given`, else its export under the cache dir (written once)."""
    return Path(given) if given else cached_gguf(None, target, "bf16")


def build_server_runners(methods: list[str], *, target: str | None, target_gguf: str | None, bf16: str | None,
                         draft_dir: Path | None, draft_gguf: str | None, draft_n: int | None, threads: int,
                         n_ctx: int, notes: list[str], spec_gguf: str | None = None,
                         spec_n: int | None = None) -> dict[str, ServerRunner]:
    """A started `ServerRunner` per requested `llamacpp-server*` / `llamacpp-dflash*` method; a method that cannot
    run is removed from `methods` with a note saying why. The caller closes the servers (`runner.server.close()`)."""
    out: dict[str, ServerRunner] = {}
    for m in [m for m, r in REFERENCES.items() if r.runner == "llamacpp-server" and m in methods]:
        ref = REFERENCES[m]
        drafted, own_file = ref.draft == "dflash", ref.own_file
        why = server_missing()
        if why is None and drafted and draft_dir is None and draft_gguf is None:
            why = "no DFlash draft (--draft DIR, or --llamacpp-draft-gguf FILE)"
        if why is None and ref.draft == "family" and not spec_gguf:
            why = "no draft model of the target's family (--llamacpp-spec-gguf FILE)"
        if why is None and own_file and not target_gguf:
            why = "no GGUF file for the target (--llamacpp-gguf PATH)"
        if why is None:
            try:
                model = Path(target_gguf) if own_file else bf16_gguf(target, bf16)
                if ref.draft == "family":
                    n = spec_n if m == "llamacpp-spec-n" else None  # the other keeps llama.cpp's default
                    out[m] = ServerRunner(LlamaServer(model, threads, n_ctx, spec_gguf, n, spec_type="draft-simple"))
                    notes.append(f"{m}: llama-server on {model.name} + draft model {Path(spec_gguf).name} "
                                 f"({'llama.cpp default draft settings' if n is None else f'{n} drafted tokens max'}"
                                 f"), {threads} threads")
                elif drafted:
                    dg = Path(draft_gguf) if draft_gguf else cached_gguf(draft_dir, target, "bf16")
                    n = draft_n or (default_draft_n(draft_dir) if draft_dir is not None else 3)
                    out[m] = ServerRunner(LlamaServer(model, threads, n_ctx, dg, n))
                    notes.append(f"{m}: llama-server on {model.name} + draft {dg.name}, {n} drafted tokens per "
                                 f"step, {threads} threads")
                else:
                    out[m] = ServerRunner(LlamaServer(model, threads, n_ctx))
                    notes.append(f"{m}: llama-server on {model.name}, no draft, {threads} threads")
            except (OSError, ValueError, RuntimeError, TimeoutError) as e:
                why = str(e)
        if why is not None:
            methods.remove(m)
            notes.append(f"{m} skipped: {why}")
    return out
