"""The CLI end to end on a tiny random LLaMA saved with the real SmolLM2 tokenizer (fast, no hub)."""

import json
import subprocess
import sys

import pytest
import torch

from blockdraft.loading import materialize, resolve_target


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(materialize(resolve_target(None)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=24, intermediate_size=37, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id, bos_token_id=1, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(cfg).save_pretrained(out)
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
