"""End-to-end `run_bench` on a tiny random target + tiny random draft with a user prompt file, and the CLI wiring."""

import argparse
import json
import statistics

import pytest
import torch

from blockdraft.eval import metrics as M
from blockdraft.cli.bench import config_from_args, register
from blockdraft.eval.bench import BenchConfig, run_bench
from blockdraft.models.target import TargetModel
from conftest import ToyTokenizer, tiny_draft, tiny_qwen3


class StubTokenizer(ToyTokenizer):
    """ToyTokenizer plus the encoding side the bench needs (ids stay inside the tiny vocabulary of 99)."""

    chat_template = "stub"

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % 89 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = [0]
        for m in messages:
            ids += [91 if m["role"] == "user" else 92] + self.encode(m["content"]) + [93]
        return ids + ([92] if add_generation_prompt else [])


PROMPTS = [
    {"id": "rep", "prompt": "abcabcabc abcabc xyz xyz xyz"},
    {"id": "two", "prompt": "hello hello", "extra_turns": ["and again"]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count 1 2 3 1 2 3"}]},
]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    pfile = root / "mine.jsonl"
    pfile.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    tok = StubTokenizer()
    target = TargetModel(tiny_qwen3(), tok)
    draft = tiny_draft(target, block_size=8)
    cfg = BenchConfig(prompts=str(pfile), n=None, max_new_tokens=24, temperatures=(0.0, 1.0), dtype="fp32",
                      multi_turn=True, out=str(root / "out"), progress=False, command="pytest", threads=1)
    return run_bench(cfg, target=target, tokenizer=tok, draft=draft), root / "out"


def test_outputs_exist(bench):
    res, out = bench
    for f in ["results.json", "report.md", "speedup_T0.png", "accept_hist_dflash_T0.png",
              "position_accept_dflash_T0.png", "accept_hist_pld_T0.png", "speedup_T1.png",
              "position_accept_dflash_T1.png"]:
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
        assert f in res["files"]
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["records"] == res["records"] and on_disk["command"] == "pytest"
    assert {"cpu", "torch", "threads", "date"} <= set(on_disk["machine"])
    man = on_disk["manifest"]
    assert {"git_commit", "git_dirty", "draft_sha256", "target_sha256", "command", "torch", "threads", "cpu",
            "date"} <= set(man)
    assert man["command"] == "pytest" and man["draft_sha256"] is None  # an in-memory draft has no files to hash
    assert res["methods"] == ["ar", "dflash", "pld", "hf-pld"]


def test_records_are_complete_and_interleaved(bench):
    res, _ = bench
    recs = res["records"]
    t0 = [r for r in recs if r["temperature"] == 0.0]
    t1 = [r for r in recs if r["temperature"] == 1.0]
    assert len(t0) == 4 * (3 + 1)  # 4 methods x (3 prompts + 1 second turn)
    assert len(t1) == 3 * (3 + 1)  # hf-pld is greedy only
    assert {r["turn"] for r in recs} == {1, 2} and all(r["task"] == "mine" for r in recs)
    # rotation: each method is not always run first
    firsts = {r["method"] for r in t0 if r["run_order"] == 0}
    assert len(firsts) >= 3
    for r in recs:
        assert 1 <= r["new_tokens"] <= 24 and r["e2e_seconds"] > 0
        if r["method"] == "hf-pld":
            assert r["tau"] is None and r["decode_tokens_per_s"] is None
            continue
        assert r["tau"] == pytest.approx(statistics.mean(r["accept_lengths"]))
        assert r["new_tokens"] <= 1 + sum(r["accept_lengths"])
        tri, acc = r["position_trials"], r["position_accepted"]
        assert len(tri) == len(acc) and all(a <= t for a, t in zip(acc, tri))
        assert all(x >= y for x, y in zip(tri, tri[1:])) and (not tri or tri[0] <= len(r["accept_lengths"]))
        # each step accepts a leading run of its drafts: accepted counts add up to the committed tokens minus 1 each
        assert sum(acc) == sum(a - 1 for a in r["accept_lengths"])
        assert r["draft_seconds"] + r["verify_seconds"] <= r["e2e_seconds"]


def test_greedy_fp32_outputs_match_ar(bench):
    res, _ = bench
    for r in res["records"]:
        if r["temperature"] == 0.0 and r["method"] in ("dflash", "pld"):
            assert r["match_ar"] is True and r["first_mismatch"] is None, (r["method"], r["prompt_id"])
        if r["method"] == "ar":
            assert r["match_ar"] is None
    rows = {r["method"]: r for r in res["summary"]["0"]["rows"]}
    assert rows["dflash"]["match_rate"] == rows["pld"]["match_rate"] == 1.0
    assert rows["hf-pld"]["match_rate"] == 1.0  # HF's own prompt lookup is lossless too (fp32, no near-ties)


def test_summary_agrees_with_records(bench):
    res, _ = bench
    recs = [r for r in res["records"] if r["temperature"] == 0.0]
    rows = {r["method"]: r for r in res["summary"]["0"]["rows"]}
    ar = {(r["prompt_id"], r["turn"]): r for r in recs if r["method"] == "ar"}
    for m in ("dflash", "pld"):
        mine = [r for r in recs if r["method"] == m]
        row = rows[m]
        assert row["n"] == 4
        assert row["tau"] == pytest.approx(M.pooled_tau(r["accept_lengths"] for r in mine))
        steps = sum(len(r["accept_lengths"]) for r in mine)
        assert sum(row["accept_hist"]) == steps and len(row["accept_hist"]) == res["block_sizes"][m]
        assert row["position_trials"][0] == sum(r["position_trials"][0] for r in mine if r["position_trials"])
        ratios = [r["decode_tokens_per_s"] / ar[(r["prompt_id"], r["turn"])]["decode_tokens_per_s"] for r in mine]
        assert row["decode_speedup"]["median"] == pytest.approx(statistics.median(ratios))
        e2e = [ar[(r["prompt_id"], r["turn"])]["e2e_seconds"] / r["e2e_seconds"] for r in mine]
        assert row["e2e_speedup"]["min"] == pytest.approx(min(e2e))
    assert rows["hf-pld"]["decode_speedup"] is None and rows["hf-pld"]["e2e_speedup"]["n"] == 4


def test_report_shows_the_summary(bench):
    res, out = bench
    text = (out / "report.md").read_text()
    assert "## Temperature 0" in text and "## Temperature 1" in text
    assert "### Per-position acceptance (dflash, T=0)" in text
    row = next(r for r in res["summary"]["0"]["rows"] if r["method"] == "dflash")
    s = row["decode_speedup"]
    assert f"| mine | dflash | 4 | {row['tau']:.2f} |" in text
    assert f"{s['median']:.2f}× [{s['min']:.2f}–{s['max']:.2f}]" in text
    assert "![speedup_T0.png](speedup_T0.png)" in text


def test_missing_draft_skips_dflash_with_a_note(tmp_path):
    tok = StubTokenizer()
    target = TargetModel(tiny_qwen3(), tok)
    pfile = tmp_path / "p.jsonl"
    pfile.write_text(json.dumps(PROMPTS[0]) + "\n")
    cfg = BenchConfig(draft="none", prompts=str(pfile), methods=("dflash", "pld"), max_new_tokens=4,
                      out=str(tmp_path / "o"), progress=False, plots=False, warmup=False, threads=1)
    res = run_bench(cfg, target=target, tokenizer=tok)
    assert res["methods"] == ["ar", "pld"]
    assert any("dflash skipped" in n for n in res["notes"]) and any("`ar` added" in n for n in res["notes"])
    assert (tmp_path / "o" / "report.md").is_file()


def test_cli_registration_and_quick():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    register(sub)
    args = parser.parse_args(["bench", "--methods", "ar,pld", "--temperatures", "0,1", "--n", "5", "--quick",
                              "--out", "x", "--block-size", "6"])
    cfg = config_from_args(args)
    assert cfg.methods == ("ar", "pld") and cfg.temperatures == (0.0, 1.0) and cfg.block_size == 6
    q = cfg.resolved()
    assert (q.n, q.max_new_tokens, q.temperatures) == (2, 64, (0.0,))
    assert config_from_args(parser.parse_args(["bench", "--temperature", "0.5"])).temperatures == (0.5,)
    with pytest.raises(ValueError):
        BenchConfig(methods=("ar", "nope")).resolved()
    with pytest.raises(ValueError):
        BenchConfig(tasks=("poetry",)).resolved()


def test_reference_methods_and_step_split(tmp_path):
    """hf (transformers generate) and the HF-module twins of ar/dflash decode the same greedy tokens in fp32 as the
    lean engine; llamacpp needs a GGUF and is skipped with a note here; the report splits step time."""
    tok = StubTokenizer()
    target = TargetModel(tiny_qwen3(), tok)
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps(p) for p in PROMPTS[:2]) + "\n")
    cfg = BenchConfig(prompts=str(pfile), methods=("ar", "ar-hf", "dflash", "dflash-hf", "hf", "llamacpp"),
                      max_new_tokens=12, out=str(tmp_path / "o"), progress=False, plots=False, threads=1,
                      dtype="fp32")
    res = run_bench(cfg, target=target, tokenizer=tok, draft=tiny_draft(target, block_size=5))
    assert res["methods"] == ["ar", "dflash", "ar-hf", "dflash-hf", "hf"]
    assert any(n.startswith("llamacpp skipped") for n in res["notes"])
    for r in res["records"]:
        if r["method"] != "ar":
            assert r["match_ar"] is True, (r["method"], r["prompt_id"])
    rows = {r["method"]: r for r in res["summary"]["0"]["rows"]}
    assert rows["hf"]["decode_tokens_per_s"]["n"] == 2 and rows["hf"]["step_ms"] is None
    for m in ("ar", "ar-hf", "dflash", "dflash-hf"):
        sm = rows[m]["step_ms"]
        assert sm["total"] == pytest.approx(sm["draft"] + sm["verify"] + sm["other"])
    assert rows["ar"]["step_ms"]["draft"] < rows["dflash"]["step_ms"]["draft"]  # ar never drafts
    assert "### Per-step time split" in (tmp_path / "o" / "report.md").read_text()


def test_weights_modes_run_side_by_side(tmp_path):
    """--weights bf16,int4: every engine method on float weights, and again as METHOD@int4 on quantized ones."""
    from blockdraft.models import quant
    from conftest import tiny_llama_q

    if quant.kernel_status() is not None:
        pytest.skip(f"no quantized kernels: {quant.kernel_status()}")
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps(p) for p in PROMPTS[:2]) + "\n")
    tok = StubTokenizer()
    target = TargetModel(tiny_llama_q(), tok)
    cfg = BenchConfig(prompts=str(pfile), n=None, max_new_tokens=16, dtype="fp32", methods=("ar", "dflash"),
                      weights=("bf16", "int4"), out=str(tmp_path / "out"), progress=False, plots=False, threads=1)
    res = run_bench(cfg, target=target, tokenizer=tok, draft=tiny_draft(target, block_size=5))
    assert res["methods"] == ["ar", "ar@int4", "dflash", "dflash@int4"]
    by = {(r["method"], r["prompt_id"]): r for r in res["records"]}
    for pid in {r["prompt_id"] for r in res["records"]}:
        assert by[("ar@int4", pid)]["weights"] == "int4" and by[("ar", pid)]["weights"] == "bf16"
        # lossless on each weight set: the draft changes nothing of the output of the weights it runs on
        assert by[("dflash@int4", pid)]["token_ids"] == by[("ar@int4", pid)]["token_ids"]
        assert by[("dflash", pid)]["token_ids"] == by[("ar", pid)]["token_ids"]
    with pytest.raises(ValueError, match="--weights"):
        BenchConfig(weights=("int3",)).resolved()


def test_drafts_compared_in_one_run(tmp_path):
    """--compare-draft b=DIR: the DFlash methods again with a second draft, as METHOD@b, prompt by prompt in the same
    run, each lossless; it is that draft they propose with."""
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps(p) for p in PROMPTS[:2]) + "\n")
    tok = StubTokenizer()
    target = TargetModel(tiny_qwen3(), tok)
    tiny_draft(target, block_size=5, seed=9).save_pretrained(tmp_path / "b")
    cfg = BenchConfig(prompts=str(pfile), n=None, max_new_tokens=16, dtype="fp32", methods=("ar", "dflash"),
                      compare_drafts=(("b", str(tmp_path / "b")),), out=str(tmp_path / "out"), progress=False,
                      plots=False, threads=1)
    res = run_bench(cfg, target=target, tokenizer=tok, draft=tiny_draft(target, block_size=5, seed=2))
    assert res["methods"] == ["ar", "dflash", "dflash@b"]
    by = {(r["method"], r["prompt_id"]): r for r in res["records"]}
    for pid in {r["prompt_id"] for r in res["records"]}:
        assert by[("dflash@b", pid)]["token_ids"] == by[("ar", pid)]["token_ids"]
    assert any("draft b:" in n for n in res["notes"])
    from blockdraft.eval.bench import METHODS
    from blockdraft.eval.engines import build_all
    from blockdraft.models.loading import load_draft

    built = build_all(cfg.resolved(), METHODS, target, tok, tiny_draft(target, block_size=5, seed=2), [])
    second = built.engines["dflash@b"].proposer.draft
    assert second is not built.engines["dflash"].proposer.draft
    saved = load_draft(tmp_path / "b", target).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in second.state_dict().items())
    first = built.engines["dflash"].proposer.draft.state_dict()
    assert any(not torch.equal(v, first[k]) for k, v in second.state_dict().items())
    for bad in ((("b", "x"), ("b", "y")), (("int8", "x"),), (("a b", "x"),)):
        with pytest.raises(ValueError, match="--compare-draft"):
            BenchConfig(compare_drafts=bad).resolved()


def test_manifest_hashes_files_and_changes_with_them(tmp_path):
    from blockdraft.eval.manifest import dir_sha256, run_manifest

    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 10)
    first = dir_sha256(d)
    assert len(first) == 64 and dir_sha256(d) == first
    (d / "model.safetensors").write_bytes(b"\0" * 9 + b"\1")
    assert dir_sha256(d) != first
    man = run_manifest(command="x", draft=d, target_file=d / "config.json")
    assert man["draft_sha256"] == dir_sha256(d) and man["target_sha256"] == dir_sha256(d / "config.json")
    assert dir_sha256(None) is None and dir_sha256(tmp_path / "missing") is None


def test_speedups_against_the_faster_llamacpp_plain_method():
    from blockdraft.eval.report import render_report, summarize_records

    tps = {"ar": [10.0, 20.0, 30.0], "dflash": [15.0, 20.0, 60.0], "llamacpp": [5.0, 8.0, 9.0],
           "llamacpp-server": [8.0, 10.0, 12.0]}  # the server is the faster by median: every ratio is against it
    records = [{"temperature": 0.0, "task": "math", "prompt_id": i, "turn": 0, "method": m, "new_tokens": 8,
                "decode_tokens_per_s": v[i], "e2e_seconds": 1.0 / v[i], "accept_lengths": None, "match_ar": True}
               for m, v in tps.items() for i in range(3)]
    rows = {r["method"]: r for r in summarize_records(records, list(tps), {}, (0.0,))["0"]["rows"]}
    assert rows["dflash"]["vs_llamacpp"]["against"] == "llamacpp-server"
    assert rows["dflash"]["vs_llamacpp"]["median"] == pytest.approx(2.0)  # 15/8, 20/10, 60/12
    assert rows["ar"]["vs_llamacpp"]["min"] == pytest.approx(1.25) and "vs_llamacpp" not in rows["llamacpp"]
    results = {"machine": {"cpu": "x", "cpu_count": 2, "threads": 2, "torch": "t", "transformers": "t", "date": "d"},
               "config": {"dtype": "bf16", "prompts": None, "tasks": ["math"], "n": 3, "max_new_tokens": 8,
                          "block_size": None, "denoise_steps": 1, "seed": 0, "multi_turn": False},
               "target": "t", "draft": "d", "methods": list(tps), "command": "c", "wall_seconds": 1.0, "notes": [],
               "summary": summarize_records(records, list(tps), {}, (0.0,)), "files": []}
    text = render_report(results)
    assert "### Against llama.cpp's plain decoding (T=0)" in text
    assert "| math | dflash | llamacpp-server | 2.00× [1.88–5.00] |" in text
    no_llama = [r for r in records if not r["method"].startswith("llamacpp")]
    rows = summarize_records(no_llama, ["ar", "dflash"], {}, (0.0,))["0"]["rows"]
    assert all("vs_llamacpp" not in r for r in rows)


def test_lookup_branches_deeper_than_the_draft_block_are_summarised(tmp_path):
    """`dflash+lookup` verifies prompt-lookup branches deeper than the draft's block: the run records, as the
    method's block, the deepest a step can verify, and every accept length fits the histogram it is summarised in
    (a repetitive prompt, so that lookup branches are long and accepted)."""
    pfile = tmp_path / "rep.jsonl"
    pfile.write_text(json.dumps({"id": "rep", "prompt": "abc " * 40}) + "\n")
    tok = StubTokenizer()
    target = TargetModel(tiny_qwen3(), tok)
    draft = tiny_draft(target, block_size=3)
    cfg = BenchConfig(prompts=str(pfile), n=None, max_new_tokens=40, temperatures=(0.0,), dtype="fp32",
                      methods=("ar", "dflash+lookup"), out=str(tmp_path / "out"), progress=False, command="pytest",
                      threads=1)
    res = run_bench(cfg, target=target, tokenizer=tok, draft=draft)
    block = res["block_sizes"]["dflash+lookup"]
    lengths = [a for r in res["records"] if r["method"] == "dflash+lookup" for a in r["accept_lengths"]]
    assert block > 3 and max(lengths) <= block
    row = {r["method"]: r for r in res["summary"]["0"]["rows"]}["dflash+lookup"]
    assert len(row["accept_hist"]) == block and sum(row["accept_hist"]) == len(lengths)
