"""Tiny random targets and drafts with odd sizes, so shape mix-ups fail loudly (vocab 99, intermediate 37...).

The targets use initializer_range 0.5: with HF's default 0.02 a random tiny model emits near-uniform logits and
greedy decoding repeats one token forever, which makes poor test material (ties, trivially predictable drafts).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.draft import DFlashConfig, DFlashDraftModel
from blockdraft.target import TargetModel

VOCAB = 99
MASK_ID = 98


def tiny_llama(seed: int = 0, layers: int = 5, dtype=torch.float32, init: float = 0.5):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=37, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=init, rope_theta=10000.0, eos_token_id=VOCAB - 2, bos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


def tiny_qwen3(seed: int = 0, layers: int = 4, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=40, intermediate_size=37, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
                      initializer_range=0.5, eos_token_id=VOCAB - 2, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


def tiny_draft(target: TargetModel, layers: int = 2, block_size: int = 8, seed: int = 1,
               dtype=torch.float32) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target(target.config, num_hidden_layers=layers, block_size=block_size,
                                   mask_token_id=MASK_ID, num_target_features=3)
    return DFlashDraftModel(cfg).to(dtype).eval()


class ToyTokenizer:
    """Decodes token i to a fixed short string; enough for stop-string and streaming tests."""

    eos_token_id = VOCAB - 2
    pieces = [f"{chr(97 + i % 26)}{'' if i < 26 else i // 26}" for i in range(VOCAB)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[int(i)] for i in ids if not (skip_special_tokens and int(i) == self.eos_token_id))


@pytest.fixture(params=["llama", "qwen3"])
def target(request) -> TargetModel:
    hf = tiny_llama() if request.param == "llama" else tiny_qwen3()
    return TargetModel(hf, ToyTokenizer())


@pytest.fixture
def llama_target() -> TargetModel:
    return TargetModel(tiny_llama(), ToyTokenizer())


def naive_greedy(target: TargetModel, prompt: torch.Tensor, n: int) -> list[int]:
    """Reference decoder with no cache at all: recompute the whole sequence for every token, plain argmax."""
    ids = prompt.clone()
    out = []
    for _ in range(n):
        nxt = int(target.hf(ids.unsqueeze(0)).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and a busy second core makes two threads crawl)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
