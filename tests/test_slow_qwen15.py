"""Qwen2.5-Coder-1.5B-Instruct (`make qwen-coder-1.5b`) with its shipped draft: lossless on the real model. Run with
`make test-slow`; skipped where the target's packages are not installed."""

import pytest
import torch

from blockdraft.config import GenerationConfig
from blockdraft.decode.engine import Engine
from blockdraft.decode.spec import AUTO, DecodeSpec, build_engine
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.loading import PARTED_TARGETS, encode_prompt, joined_gguf, load_target, resolve_draft

pytestmark = pytest.mark.slow

TARGET = "qwen2.5-coder-1.5b"
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain the difference between a list and a tuple in Python, briefly.",
           "A train travels 180 km in 2.5 hours. What is its average speed? Show your steps."]


@pytest.fixture(scope="module")
def draft_dir():
    try:
        joined_gguf(PARTED_TARGETS[TARGET])
    except FileNotFoundError as e:
        pytest.skip(str(e))
    path = resolve_draft(None, TARGET)
    if path is None:
        pytest.skip(f"no draft ships for {TARGET}")
    return path


def test_greedy_dflash_equals_plain_decoding_in_fp32(draft_dir):
    """The float model (fp32): the shipped draft's greedy output equals plain decoding's, token for token."""
    target, _ = load_target(TARGET, "fp32", weights="bf16")
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    cfg = GenerationConfig(max_new_tokens=48)
    plain, eng = Engine(target), build_engine(target, draft, DecodeSpec("dflash"))
    for p in PROMPTS:
        ids = encode_prompt(target.tokenizer, p)
        assert eng.generate(ids, cfg).token_ids == plain.generate(ids, cfg).token_ids, p


def test_greedy_dflash_equals_plain_decoding_on_the_quantized_stack(draft_dir):
    """The GGUF's own weights on the native kernels, as the product decodes: a k-token verify gives the bits of k
    one-token steps (and a tree's nodes the bits of their paths' steps), so the drafted output equals plain
    decoding's on the same stack: with the chain and with the method the draft recommends (`--method auto`)."""
    target, _ = load_target(TARGET)
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=target.dtype)
    cfg = GenerationConfig(max_new_tokens=64)
    plain = Engine(target)
    engines = [build_engine(target, draft, DecodeSpec("dflash")), build_engine(target, draft, DecodeSpec(AUTO))]
    assert engines[1].spec.method == (draft.config.decode_method or "dflash-adaptive")
    for p in PROMPTS:
        ids = encode_prompt(target.tokenizer, p)
        want = plain.generate(ids, cfg).token_ids
        for eng in engines:
            res = eng.generate(ids, cfg)
            assert res.token_ids == want, (eng.spec.method, p)
            assert max(res.stats.accept_lengths) > 1  # the draft did commit more than one token in some step
