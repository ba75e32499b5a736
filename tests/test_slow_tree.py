"""Tree verification on the real default target (SmolLM2-135M-Instruct) with the shipped draft: fp32 greedy output is
token-identical to plain decoding. Run with `make test-slow`."""

import pytest
import torch

from blockdraft.decode.calibrate import measure_verify_cost
from blockdraft.config import GenerationConfig
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.decode.engine import Engine
from blockdraft.decode.spec import DecodeSpec, build_engine
from blockdraft.models.loading import encode_prompt, load_target, resolve_draft

pytestmark = pytest.mark.slow

PROMPTS = ["What is 17 times 23? Show your steps.", "Write a Python function that reverses a string.",
           "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"]


@pytest.fixture(scope="module")
def fp32_target():
    target, _ = load_target(None, "fp32")
    return target


def test_greedy_trees_equal_plain_decoding_in_fp32(fp32_target):
    path = resolve_draft(None, "smollm2-135m-instruct")
    assert path is not None, "the default draft ships in models/"
    draft = DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    cost = measure_verify_cost(fp32_target, max_width=24, context=64, reps=1)  # the budget chosen per step
    engines = {"dflash-tree (budget 24)": build_engine(fp32_target, draft, DecodeSpec("dflash-tree", tree_budget=24)),
               "dflash+lookup (auto)": build_engine(fp32_target, draft, DecodeSpec("dflash+lookup"), verify_cost=cost)}
    plain = Engine(fp32_target)
    cfg = GenerationConfig(max_new_tokens=64)
    for p in PROMPTS:
        ids = encode_prompt(fp32_target.tokenizer, p)
        want = plain.generate(ids, cfg).token_ids
        for name, eng in engines.items():
            res = eng.generate(ids, cfg)
            assert res.token_ids == want, (name, p)
            assert res.stats.tau > 1.0 and max(res.stats.tree_nodes) > 1, (name, p)
