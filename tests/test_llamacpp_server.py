"""The llama-server plumbing of the bench's `llamacpp-dflash*` methods (eval/llamacpp_server.py) against a stand-in
`llama-server` (a small Python HTTP server with the same endpoints and fields), so no llama.cpp build is needed. The
real server is exercised by the slow tier (test_llamacpp_slow.py)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from blockdraft.eval.bench import BenchConfig, run_bench
from blockdraft.eval.llamacpp_server import LlamaServer, ServerExited, ServerRunner, default_draft_n
from blockdraft.models.target import TargetModel
from conftest import ToyTokenizer, tiny_draft, tiny_qwen3

EOS = 97
# The stand-in answers n_predict tokens (EOS last when the prompt ends with 5) and, with a draft, counts one verify
# step per 2 generated tokens after the first, 3 drafted and 1 accepted per step: llama.cpp's tau = 1 + 1/1 = 2.
FAKE = textwrap.dedent("""\
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    a = sys.argv[1:]
    port, draft = int(a[a.index("--port") + 1]), a[a.index("-md") + 1] if "-md" in a else None
    if draft and "broken" in draft:
        print("llama_model_load: error loading model: broken draft", flush=True)
        sys.exit(1)
    counters = {"drafted": 0, "accepted": 0, "steps": 0}

    class H(BaseHTTPRequestHandler):
        def reply(self, code, body, ctype="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self.reply(200, '{"status": "ok"}')
            text = "".join(f"llamacpp:spec_decode_num_{k}_total {counters[v]}\\n" for k, v in
                           (("draft_tokens", "drafted"), ("accepted_tokens", "accepted"), ("drafts", "steps")))
            self.reply(200, "# HELP x\\n" + text, "text/plain")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if draft and "crashy" in draft:  # dies mid-request, as llama.cpp does on a failed GGML_ASSERT
                print("ggml.c: GGML_ASSERT(ne0 % 32 == 0) failed", flush=True)
                import os
                os._exit(134)
            n, prompt = body["n_predict"], body["prompt"]
            toks = [(sum(prompt) + k) % 90 + 1 for k in range(n)]
            if prompt[-1] == 5:
                toks[-1] = 97
            if draft:
                steps = (n - 1 + 1) // 2
                counters.update(drafted=counters["drafted"] + 3 * steps, accepted=counters["accepted"] + steps,
                                steps=counters["steps"] + steps)
            self.reply(200, json.dumps({"tokens": toks, "content": "x", "timings": {
                "predicted_n": n, "predicted_ms": 20.0 * (n - 1), "prompt_n": len(prompt), "prompt_ms": 5.0}}))

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "llama-server"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\n" + FAKE)
    exe.chmod(0o755)
    monkeypatch.setenv("BLOCKDRAFT_LLAMACPP_BIN", str(exe.parent))
    return exe


def test_runner_reports_llamacpps_counters_and_decode_speed(fake_bin, tmp_path):
    with LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "d.gguf", draft_n=3) as srv:
        assert ["--spec-type", "draft-dflash"] == srv.cmd[srv.cmd.index("--spec-type"):][:2]
        runner = ServerRunner(srv)
        r1 = runner.run([1, 2, 3], 9, 0.0, 0, (EOS,), ToyTokenizer())
        r2 = runner.run([1, 2, 5], 5, 0.0, 0, (EOS,), ToyTokenizer())
    assert r1["llamacpp"] == {"drafted": 12, "accepted": 4, "verify_steps": 4}  # this request only, not cumulative
    assert r2["llamacpp"] == {"drafted": 6, "accepted": 2, "verify_steps": 2}
    assert r1["tau"] == r2["tau"] == 2.0
    assert r1["decode_tokens_per_s"] == pytest.approx(8 / 0.160)  # tokens after the first / time after the first
    assert r1["new_tokens"] == 9 and r1["finish_reason"] == "length"
    assert r2["token_ids"][-1] == EOS and r2["finish_reason"] == "stop"
    assert srv.proc.poll() is not None  # closed with the context


def test_server_that_fails_to_load_is_a_clear_error(fake_bin, tmp_path):
    with pytest.raises(RuntimeError, match="broken draft"):
        LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "broken.gguf", draft_n=3)
    with pytest.raises(ValueError, match="draft_n"):
        LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "d.gguf", draft_n=0)


def test_server_that_dies_mid_request_says_so_with_its_log(fake_bin, tmp_path):
    with LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "crashy.gguf", draft_n=3) as srv:
        with pytest.raises(ServerExited, match=r"(?s)exited with code 134 during a request.*GGML_ASSERT"):
            srv.complete([1, 2, 3], 4, 0.0, 0)


def test_default_draft_n_is_the_recommended_block_minus_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 16},
                                                      "blockdraft": {"decode_block_size": 4}}))
    assert default_draft_n(tmp_path) == 3
    (tmp_path / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 16}}))
    assert default_draft_n(tmp_path) == 15


class _Tok(ToyTokenizer):
    chat_template = "stub"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [0, 91] + [1 + ord(c) % 89 for c in messages[-1]["content"]] + [93, 92]


def _bench(tmp_path, **kw):
    pfile = tmp_path / "p.jsonl"
    pfile.write_text(json.dumps({"id": "a", "prompt": "abc abc"}) + "\n" + json.dumps({"id": "b", "prompt": "xy"}))
    tok = _Tok()
    target = TargetModel(tiny_qwen3(), tok)
    cfg = BenchConfig(prompts=str(pfile), n=None, max_new_tokens=8, dtype="fp32", out=str(tmp_path / "out"),
                      progress=False, plots=False, threads=1, command="pytest", **kw)
    return run_bench(cfg, target=target, tokenizer=tok, draft=tiny_draft(target, block_size=4))


def test_bench_runs_llamacpp_dflash_with_llamacpps_tau(fake_bin, tmp_path):
    (tmp_path / "t.gguf").write_bytes(b"")
    (tmp_path / "d.gguf").write_bytes(b"")
    res = _bench(tmp_path, methods=("ar", "llamacpp-dflash"), llamacpp_gguf=str(tmp_path / "t.gguf"),
                 llamacpp_draft_gguf=str(tmp_path / "d.gguf"), llamacpp_draft_n=3)
    assert res["methods"] == ["ar", "llamacpp-dflash"]
    recs = [r for r in res["records"] if r["method"] == "llamacpp-dflash"]
    assert len(recs) == 2 and all(r["tau"] == 2.0 and r["match_plain"] is None for r in recs)  # no plain run
    row = next(r for r in res["summary"]["0"]["rows"] if r["method"] == "llamacpp-dflash")
    assert row["tau"] == 2.0 and row["llamacpp"]["accept_rate"] == pytest.approx(1 / 3)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### llama.cpp's speculative decoding (T=0)" in report
    assert "| p | llamacpp-dflash | 24 | 8 | 8 | 0.33 | 2.00 | — |" in report  # 2 prompts x 8 tokens: 4 steps each


def test_bench_drops_a_server_that_dies_and_keeps_the_rest(fake_bin, tmp_path):
    (tmp_path / "t.gguf").write_bytes(b"")
    (tmp_path / "crashy.gguf").write_bytes(b"")
    res = _bench(tmp_path, methods=("ar", "llamacpp-server", "llamacpp-dflash"), llamacpp_gguf=str(tmp_path / "t.gguf"),
                 llamacpp_draft_gguf=str(tmp_path / "crashy.gguf"), llamacpp_draft_n=3)
    assert res["methods"] == ["ar", "llamacpp-server"]
    assert sorted(r["method"] for r in res["records"]) == ["ar", "ar", "llamacpp-server", "llamacpp-server"]
    note = next(n for n in res["notes"] if n.startswith("llamacpp-dflash dropped"))
    assert "exited with code 134" in note and "GGML_ASSERT" in note and "warm-up" in note
    assert "llamacpp-dflash dropped" in (tmp_path / "out" / "report.md").read_text()


def test_bench_skips_llamacpp_dflash_with_a_note_without_the_tools(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_LLAMACPP_BIN", str(tmp_path / "empty"))
    res = _bench(tmp_path, methods=("ar", "llamacpp-dflash"))
    assert res["methods"] == ["ar"]
    assert any(n.startswith("llamacpp-dflash skipped: llama-server not found") for n in res["notes"])


def test_server_with_a_draft_model_keeps_llamacpps_defaults_or_takes_a_length(fake_bin, tmp_path):
    with LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "d.gguf",
                     spec_type="draft-simple") as srv:
        assert srv.cmd[srv.cmd.index("--spec-type") + 1] == "draft-simple" and "--spec-draft-n-max" not in srv.cmd
    with LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "d.gguf", draft_n=8,
                     spec_type="draft-simple") as srv:
        assert srv.cmd[srv.cmd.index("--spec-draft-n-max") + 1] == "8"
    with pytest.raises(ValueError, match="spec_type"):
        LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "d.gguf", spec_type="medusa")
    with pytest.raises(ValueError, match="draft_n"):
        LlamaServer(tmp_path / "t.gguf", threads=1, ctx=256, draft=tmp_path / "d.gguf")  # DFlash needs its block


def test_bench_runs_llamacpp_spec_against_llamacpp_server(fake_bin, tmp_path):
    for f in ("t.gguf", "small.gguf"):
        (tmp_path / f).write_bytes(b"")
    res = _bench(tmp_path, methods=("ar", "llamacpp-server", "llamacpp-spec", "llamacpp-spec-n"),
                 llamacpp_gguf=str(tmp_path / "t.gguf"), llamacpp_spec_gguf=str(tmp_path / "small.gguf"),
                 llamacpp_spec_n=6)
    assert res["methods"] == ["ar", "llamacpp-server", "llamacpp-spec", "llamacpp-spec-n"]
    assert any("llamacpp-spec-n: llama-server on t.gguf + draft model small.gguf (6 drafted tokens max)" in n
               for n in res["notes"])
    recs = [r for r in res["records"] if r["method"].startswith("llamacpp-spec")]
    # the stand-in answers the same tokens with and without a draft: plain match against llamacpp-server
    assert len(recs) == 4 and all(r["tau"] == 2.0 and r["match_plain"] is True for r in recs)
    row = next(r for r in res["summary"]["0"]["rows"] if r["method"] == "ar")
    assert row["vs_llamacpp_spec"]["against"] in ("llamacpp-spec", "llamacpp-spec-n")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### Against llama.cpp's speculative decoding (T=0)" in report


def test_bench_skips_llamacpp_spec_without_a_draft_model(fake_bin, tmp_path):
    (tmp_path / "t.gguf").write_bytes(b"")
    res = _bench(tmp_path, methods=("ar", "llamacpp-spec"), llamacpp_gguf=str(tmp_path / "t.gguf"))
    assert res["methods"] == ["ar"]
    assert any(n.startswith("llamacpp-spec skipped: no draft model of the target's family") for n in res["notes"])
    with pytest.raises(ValueError, match="llamacpp-spec-n must be >= 1"):
        _bench(tmp_path, methods=("ar",), llamacpp_spec_n=0)
