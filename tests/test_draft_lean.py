"""The draft's lean decode forward (draft_lean.py) against the module it is built from: the same context keys and
values, the same hidden states, the cache left as it was, and the same proposals through DFlashProposer."""

import pytest
import torch

from blockdraft.models.cache import KVCache
from blockdraft.config import SamplingParams
from blockdraft.models.draft_lean import LeanDraft
from blockdraft.decode.proposers.dflash import DFlashProposer
from blockdraft.decode.tree import Tree
from conftest import MASK_ID, tiny_draft

# fp32: fused projections sum each output in the same order as separate ones, but SDPA over a cache view and over a
# concatenated tensor may block differently; 1e-5 of activations of order 1-10 covers that and nothing more
TOL = dict(rtol=1e-5, atol=1e-5)


def _trained_looking(draft):
    with torch.no_grad():  # non-trivial norms and q/k norms, which a fresh draft has at 1
        for i, p in enumerate(draft.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    return draft


@pytest.mark.parametrize("layers,mlp,mix", [(1, None, False), (3, None, False), (1, 23, False), (3, None, True)])
def test_lean_context_and_block_equal_the_module(target, layers, mlp, mix):
    """mlp: a draft MLP narrower than the target's (odd width) instead of the target's own; mix: each layer mixes
    the fused inputs with its own (perturbed, so unequal) weights."""
    draft = _trained_looking(tiny_draft(target, layers=layers, intermediate_size=mlp, layer_mix=mix))
    lean = LeanDraft(draft)
    cfg = draft.config
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 9, cfg.num_target_features * target.hidden_size, generator=g)
    pos = torch.arange(9).unsqueeze(0)
    ks, vs = draft.context_kv(feats, pos)
    lks, lvs = lean.context_kv(feats, pos)
    torch.testing.assert_close(lks, ks, **TOL)
    torch.testing.assert_close(lvs, vs, **TOL)
    ctx = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, 10, torch.float32, "cpu")  # must grow
    ctx.append(lks[:, :, :, :4], lvs[:, :, :, :4])  # context appended in two pieces, as decoding does
    a, b = lean.context_kv(feats[:, 4:], pos[:, 4:])
    ctx.append(a, b)
    block = torch.full((1, 5), MASK_ID)
    block[0, 0] = 7
    bpos = torch.arange(9, 14).unsqueeze(0)
    ref = draft(target.embed(block), bpos, ks, vs)
    out = lean.forward(target.embed(block), bpos, ctx)
    torch.testing.assert_close(out, ref, **TOL)
    assert ctx.length == 9  # the block's keys were written after the context but not kept
    torch.testing.assert_close(lean.forward(target.embed(block), bpos, ctx), out, rtol=0, atol=0)


def test_lean_bf16_prepacked_stays_close_to_the_module(llama_target):
    """bf16 with oneDNN-prepacked weights (when available): the same function up to bf16 rounding (a few 1e-2 of
    activations of order 1-10 after three roundings per layer)."""
    draft = _trained_looking(tiny_draft(llama_target, layers=2)).to(torch.bfloat16)
    lean = LeanDraft(draft)
    cfg = draft.config
    feats = torch.randn(1, 6, cfg.num_target_features * llama_target.hidden_size,
                        generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    pos = torch.arange(6).unsqueeze(0)
    ks, vs = draft.context_kv(feats, pos)
    ctx = KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, 16, torch.bfloat16, "cpu")
    ctx.append(*lean.context_kv(feats, pos))
    block = torch.full((1, 4), MASK_ID)
    emb = llama_target.embed(block).to(torch.bfloat16)
    bpos = torch.arange(6, 10).unsqueeze(0)
    ref = draft(emb, bpos, ks, vs).float()
    out = lean.forward(emb, bpos, ctx).float()
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()


def test_proposer_lean_and_module_paths_propose_the_same(llama_target):
    draft = _trained_looking(tiny_draft(llama_target, layers=2, block_size=6))
    prompt = torch.randint(0, 90, (12,), generator=torch.Generator().manual_seed(3))
    llama_target.set_layer_ids(tuple(draft.config.target_layer_ids))
    feats = llama_target.forward(prompt.unsqueeze(0), None).features
    props = []
    for lean in (True, False):
        p = DFlashProposer(draft, llama_target, lean=lean)
        p.start(prompt, feats[:, :-1])
        props.append((p.propose(prompt, 5, SamplingParams(), None).candidates,
                      p.distributions(prompt, 5, SamplingParams())))
    assert torch.equal(props[0][0], props[1][0])
    torch.testing.assert_close(props[0][1], props[1][1], **TOL)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "module"])
def test_next_token_feature_pairs_each_context_position_with_the_token_after_it(llama_target, lean):
    """A draft with next_token_feature: the proposer's context keys/values equal the draft's own context_kv over
    [features at i ; embedding of token i+1] (the naive pairing), across start, accept and two proposals; the
    newest position's next token is the anchor, known only when drafting starts."""
    draft = _trained_looking(tiny_draft(llama_target, layers=2, block_size=6).with_next_token_feature(scale=7.0))
    tokens = torch.randint(0, 90, (14,), generator=torch.Generator().manual_seed(5))
    llama_target.set_layer_ids(tuple(draft.config.target_layer_ids))
    feats = llama_target.forward(tokens.unsqueeze(0), None).features  # [1, 14, K*H]
    p = DFlashProposer(draft, llama_target, lean=lean)
    p.start(tokens[:8], feats[:, :8])  # the prompt's 8 positions; tokens[8] came from the prefill
    p.propose(tokens[:9], 5, SamplingParams(), None)
    p.accept(Tree.chain(tokens[8], tokens[9:11]), [0, 1, 2], feats[:, 8:11])  # the anchor, two accepted drafts;
    # tokens[11] is the new anchor
    p.propose(tokens[:12], 5, SamplingParams(), None)
    fused = torch.cat([feats[:, :11], 7.0 * llama_target.embed(tokens[1:12].unsqueeze(0))], dim=-1)
    ks, vs = draft.context_kv(fused, torch.arange(11).unsqueeze(0))
    assert p.ctx.length == 11
    for i in range(draft.config.num_hidden_layers):
        k, v = p.ctx.view(i)
        torch.testing.assert_close(k, ks[i], **TOL)
        torch.testing.assert_close(v, vs[i], **TOL)
