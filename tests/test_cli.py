"""The CLI end to end on a tiny random LLaMA saved with the real SmolLM2 tokenizer (fast, no hub)."""

import json
import statistics
import subprocess
import sys

import pytest
import torch

from blockdraft.models.loading import materialize, resolve_target
from conftest import seeded
from test_llamacpp_server import fake_bin  # noqa: F401 - the stand-in llama-server, a fixture


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(materialize(resolve_target(None)))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=24, intermediate_size=37, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id, bos_token_id=1, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("tiny-target")
    with seeded(0):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "blockdraft.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def test_generate_json_plain_and_with_a_draft(tiny_dir, tmp_path):
    common = ["--target", tiny_dir, "--dtype", "fp32", "--max-new-tokens", "24", "--json"]
    plain = json.loads(run("generate", "--draft", "none", *common, "Hello there").stdout)
    assert plain["tau"] == 1.0 and len(plain["token_ids"]) <= 24 and plain["target_forwards"] >= 1
    run("init-draft", "--target", tiny_dir, "--layers", "1", "--block-size", "4", "--out", tmp_path / "d")
    spec = json.loads(run("generate", "--draft", tmp_path / "d", *common, "Hello there").stdout)
    assert spec["token_ids"] == plain["token_ids"]  # lossless (fp32, greedy)
    assert {"text", "accept_lengths", "seconds"} <= set(spec)


def test_streaming_output_and_errors(tiny_dir, tmp_path):
    p = run("generate", "--target", tiny_dir, "--draft", "none", "--dtype", "fp32", "--max-new-tokens", "8", "Hi")
    assert "tau 1.00" in p.stderr
    bad = run("generate", "--target", tiny_dir, "--draft", "none", "--temperature", "-1", "Hi", check=False)
    assert bad.returncode == 2 and "temperature" in bad.stderr
    missing = run("generate", "--target", tiny_dir, "--draft", tmp_path / "nope", "Hi", check=False)
    assert missing.returncode == 2 and "not found" in missing.stderr
    long_prompt = "word " * 400
    too_long = run("generate", "--target", tiny_dir, "--draft", "none", long_prompt, check=False)
    assert too_long.returncode == 2 and "context" in too_long.stderr


def test_train_checkpoints_on_sigterm_and_resumes(tiny_dir, tmp_path):
    """A killed training run (SIGTERM) leaves a complete checkpoint, and --resume carries on to the end."""
    import signal
    import time

    shards = tmp_path / "shards"
    shards.mkdir()
    g = torch.Generator().manual_seed(0)
    with open(shards / "shard-00000.jsonl", "w") as f:
        for i in range(8):
            ids = torch.randint(20, 1000, (40,), generator=g).tolist()
            f.write(json.dumps({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * 10 + [1] * 30}) + "\n")
    out = tmp_path / "run"
    args = [sys.executable, "-m", "blockdraft.cli", "train", "--target", str(tiny_dir), "--data", str(shards),
            "--out-dir", str(out), "--num-layers", "1", "--block-size", "4", "--anchors", "4",
            "--seqs-per-step", "1", "--steps", "100000", "--save-every", "100000", "--log-every", "1",
            "--precision", "fp32", "--init", "random", "--draft-vocab-size", "0", "--eval-every", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and len(log.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "state.json").is_file()
    step = json.loads((ckpts[0] / "state.json").read_text())["step"]
    assert step >= 3 and (out / "draft" / "config.json").is_file()
    fresh = run(*args[3:], check=False)
    assert fresh.returncode == 2 and "--resume" in fresh.stderr  # never silently overwrites a run
    args[args.index("--steps") + 1] = str(step + 2)
    done = run(*args[3:], "--resume")
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == step + 2


def test_training_quickstart_end_to_end_at_a_small_size(tiny_dir, tmp_path):
    """The README's training commands as a new user runs them, at the smallest size: prompts and the target's own
    answers (a held-out split even from a dozen prompts per source), the teacher caches of both splits, a short
    `train --cache` run (its learning curve on the held-out cache), decoding with the new draft, a chain selector
    fitted to it."""
    regen, cache, run_dir = tmp_path / "regen", tmp_path / "cache", tmp_path / "run"
    run("data", "--target", tiny_dir, "--out", regen, "--n-sharegpt", "12", "--n-gsm", "12", "--max-new-tokens", "8",
        "--batch-size", "8", "--dtype", "fp32", "--threads", "1")
    assert list((regen / "shards-heldout").glob("*.jsonl")), "no held-out shard written"
    for split, data in (("train", regen / "shards"), ("heldout", regen / "shards-heldout")):
        run("teacher-cache", "--target", tiny_dir, "--data", data, "--out", cache / split, "--layer-ids", "1,2",
            "--dtype", "fp32", "--threads", "1")
    past = run("teacher-cache", "--target", tiny_dir, "--data", regen / "shards", "--out", cache / "past",
               "--offset", "100000", "--dtype", "fp32", check=False)
    assert past.returncode == 2 and "--offset" in past.stderr and not (cache / "past").exists()
    out = run("train", "--target", tiny_dir, "--cache", cache / "train", "--heldout-cache", cache / "heldout",
              "--out-dir", run_dir, "--num-layers", "1", "--layer-ids", "1,2", "--block-size", "4", "--steps", "4",
              "--eval-every", "2", "--eval-seqs", "4", "--walk-seqs", "2", "--draft-vocab-size", "64",
              "--precision", "fp32", "--threads", "1")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and "tau4" in summary
    curve = [json.loads(x) for x in (run_dir / "curve.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [0, 2, 4]
    gen = json.loads(run("generate", "--target", tiny_dir, "--draft", run_dir / "draft", "--dtype", "fp32",
                         "--max-new-tokens", "12", "--json", "Hello there").stdout)
    plain = json.loads(run("generate", "--target", tiny_dir, "--draft", "none", "--dtype", "fp32",
                           "--max-new-tokens", "12", "--json", "Hello there").stdout)
    assert gen["text"] == plain["text"]  # lossless with the new draft
    # a chain selector fitted to it: the draft with its selector decodes to the same text
    out = run("train-selector", "--target", tiny_dir, "--draft", run_dir / "draft", "--cache", cache / "train",
              "--heldout-cache", cache / "heldout", "--out", tmp_path / "sel", "--rank", "8", "--top-k", "8",
              "--anchors", "4", "--epochs", "1", "--threads", "1")
    fit = json.loads(out.stdout.strip().splitlines()[-1])
    assert fit["rows"] > 0 and fit["selector"]["tau"] >= 1.0
    gen = json.loads(run("generate", "--target", tiny_dir, "--draft", tmp_path / "sel" / "draft", "--dtype", "fp32",
                         "--max-new-tokens", "12", "--json", "Hello there").stdout)
    assert gen["text"] == plain["text"]
    # the ship criterion: held-out tau of the new draft beside another one, in one run
    run("init-draft", "--target", tiny_dir, "--layers", "1", "--block-size", "4", "--out", tmp_path / "untrained")
    out = run("heldout-tau", "--target", tiny_dir, "--draft", f"new={run_dir / 'draft'}",
              "--draft", f"untrained={tmp_path / 'untrained'}", "--heldout", regen / "shards-heldout",
              "--prompts", "2", "--max-new-tokens", "8", "--weights", "bf16", "--out", tmp_path / "tau.jsonl")
    rows = [json.loads(x) for x in out.stdout.strip().splitlines()]
    assert [r["draft"] for r in rows] == ["new", "untrained"] and all(r["tau"] >= 1.0 for r in rows)
    assert all(r["prompts"] >= 1 for r in rows)
    assert len((tmp_path / "tau.jsonl").read_text().splitlines()) == 2


def test_step_profile_times_steps_linears_and_a_draft_step(tiny_dir, tmp_path):
    """`blockdraft step-profile` end to end: every part it reports is written (figures, not timing assertions)."""
    run("init-draft", "--target", tiny_dir, "--layers", "1", "--block-size", "4", "--out", tmp_path / "d")
    out = tmp_path / "profile.json"
    run("step-profile", "--target", tiny_dir, "--dtype", "fp32", "--widths", "1,2", "--rounds", "1", "--reps", "2",
        "--layers", "1,2", "--paths", "auto-native", "--parts", "ceiling,linears,head,read,draft",
        "--draft", tmp_path / "d",
        "--threads", "1", "--out", out)
    r = json.loads(out.read_text())
    assert r["command"].startswith("blockdraft step-profile --target") and "--widths 1,2 " in r["command"]
    assert set(r["ms"]["auto-native"]) == {"1", "2"} and r["ratio_to_one_token"]["1"] == 1.0
    assert r["draft"]["block"] == 4 and r["draft"]["ms"] > 0 and r["draft"]["share_of_one_token"] > 0
    assert set(r["linears"]["rows"]) == {"1", "2"} and r["linears"]["count"] == 16
    assert all(v > 0 for v in r.get("ceiling_gmacs", {}).values())
    assert set(r["head"]["rows"]) == {"1", "2"} and r["read"]["gb_per_s"] > 0
    assert r["read"]["layers_mb"] > 0 and r["read"]["head_mb"] > 0 and r["read"]["floor_ms"] > 0
    nodraft = run("step-profile", "--target", tiny_dir, "--dtype", "fp32", "--widths", "1", "--layers", "1,2",
                  "--paths", "auto-native", "--parts", "draft", check=False)
    assert nodraft.returncode != 0 and "--draft DIR" in nodraft.stderr


def test_prefill_bench_pairs_the_engine_with_llamacpp_servers_own_timing(tiny_dir, tmp_path, monkeypatch, fake_bin):
    """`blockdraft prefill-bench` end to end against a stand-in llama-server (its prompt timing is fixed at 5 ms,
    so the ratio is the engine's own time against it; figures, not timing assertions)."""
    (tmp_path / "t.gguf").write_bytes(b"GGUF")  # the stand-in never reads it
    run("init-draft", "--target", tiny_dir, "--layers", "1", "--block-size", "4", "--out", tmp_path / "d")
    out = tmp_path / "prefill.json"
    p = run("prefill-bench", "--target", tiny_dir, "--dtype", "fp32", "--tokens", "40,100", "--rounds", "2",
            "--draft", tmp_path / "d", "--threads", "1", "--llamacpp-gguf", tmp_path / "t.gguf", "--out", out)
    r = json.loads(out.read_text())
    assert set(r["seconds"]) == {"ar", "dflash", "llamacpp-server"}
    assert all(len(v) == 2 for by_n in r["seconds"].values() for v in by_n.values())
    assert r["seconds"]["llamacpp-server"]["100"] == [0.005, 0.005]
    for m in ("ar", "dflash"):
        for n in ("40", "100"):
            ours = r["seconds"][m][n]
            assert min(ours) > 0
            assert r["median"][m][n]["tokens_per_s"] == pytest.approx(int(n) / statistics.median(ours))
            # paired per round: each round's llama time over that round's own time
            assert r["ratio_to_llamacpp_server"][m][n] == pytest.approx(statistics.median(0.005 / s for s in ours))
    assert "| ar |" in p.stdout and "dflash" in p.stdout
    too_long = run("prefill-bench", "--target", tiny_dir, "--tokens", "500", "--methods", "ar", check=False)
    assert too_long.returncode != 0 and "context" in too_long.stderr
    bad = run("prefill-bench", "--target", tiny_dir, "--methods", "ar,vllm", check=False)
    assert bad.returncode != 0 and "vllm" in bad.stderr
    bad = run("prefill-bench", "--target", tiny_dir, "--tokens", "64,many", check=False)
    assert bad.returncode != 0 and "--tokens" in bad.stderr
    monkeypatch.setenv("BLOCKDRAFT_LLAMACPP_BIN", str(tmp_path / "nowhere"))
    alone = run("prefill-bench", "--target", tiny_dir, "--tokens", "64", "--methods", "llamacpp-server", check=False)
    assert alone.returncode != 0 and "nothing to measure" in alone.stderr and "not found" in alone.stderr


def test_serve_flags_map_onto_the_servers_config_and_back():
    """Each `blockdraft serve` flag is the ServeConfig field of the same name: the flags `ServeConfig.argv` writes
    (what the soak test and serve-bench start a server with) parse back to the same config, the defaults agree, and
    a bad limit is refused when the config is made, before any model loads."""
    import dataclasses

    from blockdraft.cli import build_parser
    from blockdraft.cli.serve import serve_config
    from blockdraft.serve.config import ServeConfig

    parser = build_parser()
    assert serve_config(parser.parse_args(["serve", "--api-key", "k"])) == ServeConfig(api_key="k")
    cfg = ServeConfig(target="t", draft="none", method="ar", recalibrate=True, port=0, max_batch=3, max_queue=0,
                      max_tokens_cap=40, body_timeout=2.5, threads=1, max_step_tokens=7)
    back = serve_config(parser.parse_args(["serve", *cfg.argv(), "--api-key", "k"]))
    assert back == dataclasses.replace(cfg, api_key="k")
    assert "--api-key" not in ServeConfig(api_key="secret").argv()
    with pytest.raises(ValueError, match="--max-batch"):
        ServeConfig(max_batch=0)
    with pytest.raises(ValueError, match="--body-timeout"):
        ServeConfig(body_timeout=0)


def test_soak_report_records_its_options_as_json():
    """The soak report's config: the run's options under the names of `blockdraft soak`'s flags, as JSON."""
    from blockdraft.eval.soak import SoakConfig, Tally
    from blockdraft.eval.soak_report import markdown, summarize
    from blockdraft.serve.config import ServeConfig

    cfg = SoakConfig(server=ServeConfig(port=0, max_batch=2, max_queue=3, max_tokens_cap=16), minutes=0.5,
                     command="blockdraft soak --minutes 0.5")
    rep = summarize(cfg, Tally(), [], 0.0, 1.0, ("a", "a"), {}, {}, {"errors": 0, "worker_alive": True}, 0, 1.0)
    c = json.loads(json.dumps(rep))["config"]
    assert c["minutes"] == 0.5 and c["max_batch"] == 2 and c["max_queue"] == 3 and c["max_tokens"] == 16
    assert "max-batch 2, max-queue 3" in markdown(rep) and "`blockdraft soak --minutes 0.5`" in markdown(rep)


def test_every_subcommand_prints_its_help():
    """`--help` of each subcommand formats (argparse expands % in help strings, so a bare one breaks it)."""
    import argparse

    from blockdraft.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) > 10
    for name, parser in sub.choices.items():
        assert parser.format_help().startswith("usage:"), name
