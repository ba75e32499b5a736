"""Tiny random targets and drafts with odd sizes, so shape mix-ups fail loudly (vocab 99, intermediate 37...).

The targets use initializer_range 0.5: with HF's default 0.02 a random tiny model emits near-uniform logits and
greedy decoding repeats one token forever, which makes poor test material (ties, trivially predictable drafts).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.draft_config import DFlashConfig
from blockdraft.models.target import TargetModel

VOCAB = 99
MASK_ID = 98


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block on torch's global RNG seeded with `seed`, then restore the global state. HF modules draw their
    initial weights from the global RNG (no generator argument), so a tiny model is built inside this block: its
    weights depend on `seed` alone, and building it does not shift the random stream seen by whatever runs next."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_llama(seed: int = 0, layers: int = 5, dtype=torch.float32, init: float = 0.5):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=37, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=init, rope_theta=10000.0, eos_token_id=VOCAB - 2, bos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=False)
    with seeded(seed):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def tiny_llama_q(seed: int = 0, dtype=torch.float32, tied: bool = False):
    """A llama whose sizes the quantized kernels take (hidden and intermediate multiples of 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.5, eos_token_id=97, bos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=tied)
    with seeded(seed):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def tiny_qwen3(seed: int = 0, layers: int = 4, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=40, intermediate_size=37, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
                      initializer_range=0.5, eos_token_id=VOCAB - 2, tie_word_embeddings=True)
    with seeded(seed):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def tiny_qwen2_with_biases(seed: int = 0, hidden: int = 32, intermediate: int = 37, dtype=torch.float32):
    """A tiny Qwen2 (q/k/v biases) whose biases are random: HF zero-initialises them, which would hide a path that
    drops them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)
    with seeded(seed):
        model = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_()
    return model.to(dtype)


def tiny_draft(target: TargetModel, layers: int = 2, block_size: int = 8, seed: int = 1,
               dtype=torch.float32, intermediate_size: int | None = None,
               layer_mix: bool = False) -> DFlashDraftModel:
    """intermediate_size: the draft's MLP width (None: the target's); layer_mix: each layer mixes the fused inputs
    with its own weights."""
    mlp = {"intermediate_size": intermediate_size} if intermediate_size else {}
    cfg = DFlashConfig.from_target(target.config, num_hidden_layers=layers, block_size=block_size,
                                   mask_token_id=MASK_ID, num_target_features=3, layer_mix=layer_mix, **mlp)
    with seeded(seed):
        draft = DFlashDraftModel(cfg)
    return draft.to(dtype).eval()


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


@pytest.fixture(autouse=True)
def _restore_torch_process_state():
    """Undo what a test (or library code it calls: trainers seed the global RNG, data regeneration sets the thread
    count) did to process-wide torch state, so that no test's outcome depends on which tests ran before it: fp32
    results differ at ~1e-5 relative between thread counts, and a leaked `set_num_threads(1)` once made a tolerance
    pass or fail depending on the order."""
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    with torch.random.fork_rng(devices=[]):
        yield
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and a busy second core makes two threads crawl)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
