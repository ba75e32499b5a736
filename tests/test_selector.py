"""The chain selector (models/selector.py, train/selector.py): its choices against a naive loop, a fresh selector
changing nothing, losslessness through the engine (greedy and sampled), the public layout kept on disk, and its fit
learning, resuming exactly and matching what decoding computes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.decode.engine import Engine
from blockdraft.decode.proposers.dflash import DFlashProposer
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models import quant, selector as selector_mod
from blockdraft.models.selector import (SELECTOR_WEIGHTS_NAME, ChainSelector, ChainView, choose_chain,
                                       choose_chain_greedy)
from blockdraft.models.target import TargetModel
from blockdraft.train.selector import SelectorConfig, train_selector
from blockdraft.train.teacher import build_teacher_cache
from conftest import ToyTokenizer, naive_greedy, seeded, tiny_draft, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _active(selector: ChainSelector, seed: int, scale: float = 0.5) -> ChainSelector:
    """Random output weights (a fresh selector's are zero and change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        selector.w_out.weight.copy_(torch.randn(selector.w_out.weight.shape, generator=g) * scale)
        selector.w_in.bias.copy_(torch.randn(selector.w_in.bias.shape, generator=g) * 0.1)
    return selector


def _selector_draft(target, rank=6, top_k=5, seed=5, scale=0.5, block_size=8):
    draft = tiny_draft(target, block_size=block_size, seed=seed)
    with seeded(seed):
        draft = draft.with_selector(rank, top_k).eval()
    _active(draft.selector, seed, scale)
    return draft


def test_choose_chain_equals_a_naive_loop():
    """Each row's choice is the argmax, over the row's K best columns, of score + z . W[id] with z from the
    selector's formula written out, the previous row's choice (the anchor for row 1) fed as its embedding; the
    returned scores hold those values on the K columns and -inf elsewhere. Columns map to ids row by row."""
    g = torch.Generator().manual_seed(0)
    V, H, G, Vs, K = 31, 10, 5, 17, 4
    emb, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    col_ids = torch.randint(0, V, (G, Vs), generator=g)  # row-aware column -> id map (a copy gate's shape)
    sel = _active(ChainSelector(H, 7, K), seed=1, scale=1.0)
    scores, hidden = torch.randn(G, Vs, generator=g), torch.randn(G, H, generator=g)

    def to_ids(cols):
        return col_ids.gather(1, cols.reshape(G, -1)).reshape(cols.shape)

    with torch.no_grad():
        chosen, out = choose_chain(ChainView(sel), scores, hidden, 3, to_ids, lambda i: emb[i], head,
                                   lambda k, cand: int(cand.argmax()))
    prev = 3
    for k in range(G):
        top = scores[k].topk(K).indices
        x = torch.cat([hidden[k] / hidden[k].pow(2).mean().add(1e-6).sqrt(),
                       emb[prev] / emb[prev].pow(2).mean().add(1e-6).sqrt()])
        z = (sel.w_out.weight @ F.silu(sel.w_in.weight @ x + sel.w_in.bias)).detach()
        want = {int(c): float(scores[k, c] + head[col_ids[k, c]] @ z) for c in top}
        assert int(chosen[k]) == max(want, key=want.get)
        for c, v in want.items():  # fp32 sums in another order
            assert float(out[k, c]) == pytest.approx(v, rel=1e-5, abs=1e-5)
        assert int(torch.isfinite(out[k]).sum()) == K
        prev = int(col_ids[k, chosen[k]])


needs_kernels = pytest.mark.skipif(quant.kernel_status() is not None,
                                   reason=f"no quantized kernels: {quant.kernel_status()}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_greedy_chain_equals_the_torch_chain(dtype):
    """One native call (csrc/chain.h) chooses what the torch chain chooses and scores the candidates alike (fp32
    sums in another order: 1e-5), over blocks whose anchors and choices repeat tokens, so its store of token parts
    is read as well as filled; the inputs in float32 or bf16 as targets hold them."""
    kernels = quant.quant_kernels()
    g = torch.Generator().manual_seed(11)
    V, H, G, Vs, K, R = 53, 37, 3, 29, 5, 11  # odd sizes: every vector loop has a tail
    emb, head = torch.randn(V, H, generator=g).to(dtype), torch.randn(V, H, generator=g).to(dtype)
    col_ids = torch.randint(0, V, (G, Vs), generator=g)
    view = ChainView(_active(ChainSelector(H, R, K), seed=2, scale=1.0))

    def to_ids(cols):
        return col_ids.gather(1, cols.reshape(G, -1)).reshape(cols.shape)

    with torch.no_grad():
        for block in range(12):
            scores, hidden = torch.randn(G, Vs, generator=g), torch.randn(G, H, generator=g).to(dtype)
            anchor = int(col_ids[0, block % 4])
            want, want_scores = choose_chain(view, scores, hidden, anchor, to_ids, lambda i: emb[i], head,
                                             lambda k, cand: int(cand.argmax()))
            top_s, top_c = scores.topk(K, dim=-1)
            chosen, cand = view.native_chain(kernels, top_s, to_ids(top_c), hidden, anchor, emb, head)
            assert torch.equal(top_c.gather(1, chosen.unsqueeze(1)).squeeze(1), want)
            torch.testing.assert_close(cand, want_scores.gather(1, top_c), rtol=1e-5, atol=1e-5)
            assert torch.equal(choose_chain_greedy(view, scores, hidden, anchor, to_ids, lambda i: emb[i], head,
                                                   emb), want)
    with pytest.raises(RuntimeError, match="out of range"):  # a bad id is an error, not a read past the table
        view.native_chain(kernels, top_s, torch.full((G, K), V, dtype=torch.long), hidden, 0, emb, head)


@needs_kernels
def test_decoding_chains_natively_proposes_what_the_torch_chain_proposes(llama_target, monkeypatch):
    """The proposer's greedy chain goes native when the kernels are loaded and the target's embedding is a plain
    lookup; with the kernels hidden from it, the torch chain proposes the same blocks."""
    quant.quant_kernels()
    draft = _selector_draft(llama_target, scale=8.0)
    seq = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(3))
    calls = []
    real = ChainView.native_chain
    monkeypatch.setattr(ChainView, "native_chain", lambda self, *a: calls.append(1) or real(self, *a))
    native = [_first_proposal(draft, llama_target, seq[:n], True) for n in range(14, 40, 5)]
    assert len(calls) == len(native)
    monkeypatch.setattr(selector_mod, "loaded_kernels", lambda: None)
    assert [_first_proposal(draft, llama_target, seq[:n], True) for n in range(14, 40, 5)] == native
    assert len(calls) == len(native)


@pytest.mark.parametrize("vocab", [None, "reduced"])
def test_a_fresh_selector_proposes_what_the_draft_proposes(llama_target, vocab):
    """Zero output weights: the same greedy proposals and acceptance as the draft without a selector."""
    draft = tiny_draft(llama_target, block_size=8, seed=5)
    if vocab:
        with seeded(5):
            draft = DFlashDraftModel(replace(draft.config, draft_vocab_size=33)).eval()
        draft.set_draft_vocab(torch.arange(0, 99, 3))
    with seeded(6):
        fresh = draft.with_selector(6, 5).eval()
    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7])
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    a = Engine(llama_target, DFlashProposer(draft, llama_target, block_size=5)).generate(prompt, cfg)
    b = Engine(llama_target, DFlashProposer(fresh, llama_target, block_size=5)).generate(prompt, cfg)
    assert a.token_ids == b.token_ids and a.stats.accept_lengths == b.stats.accept_lengths


def _first_proposal(draft, target, prefix, lean):
    prop = DFlashProposer(draft, target, block_size=6, lean=lean)
    target.set_layer_ids(prop.layer_ids)
    prop.start(prefix[:-1], target(prefix[:-1].unsqueeze(0), None).features)
    return prop.propose(prefix, 5, SamplingParams(), None).candidates.tolist()


@pytest.mark.parametrize("lean", [True, False])
def test_greedy_with_an_active_selector_is_token_exact(target, lean):
    """Greedy output stays the target's while the selector changes the proposals (some differ from the draft's
    own)."""
    draft = _selector_draft(target, scale=8.0)
    prompt = torch.randint(0, 90, (13,), generator=torch.Generator().manual_seed(7))
    cfg = GenerationConfig(max_new_tokens=36, ignore_eos=True)
    res = Engine(target, DFlashProposer(draft, target, block_size=6, lean=lean)).generate(prompt, cfg)
    assert res.token_ids == naive_greedy(target, prompt, 36)
    seq = torch.cat([prompt, torch.tensor(res.token_ids)])
    differ = [_first_proposal(draft, target, seq[:n], lean) != _first_proposal(draft.without_selector(), target,
                                                                               seq[:n], lean)
              for n in range(14, 40, 5)]
    assert any(differ), "the selector should change some proposals"


def test_sampled_rows_are_the_selectors_conditionals(llama_target):
    """At T > 0 each recorded q row is a distribution over the row's K candidates only, the drawn token has mass,
    and row k's q is the selector's distribution given the tokens drawn before it (recomputed here)."""
    draft = _selector_draft(llama_target, top_k=4)
    prompt = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7])
    prop = DFlashProposer(draft, llama_target, block_size=6, lean=False)
    llama_target.set_layer_ids(prop.layer_ids)
    prop.start(prompt[:-1], llama_target(prompt[:-1].unsqueeze(0), None).features)
    p = prop.propose(prompt, 5, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert p.q.shape == (5, 99)
    torch.testing.assert_close(p.q.sum(-1), torch.ones(5))
    assert ((p.q > 0).sum(-1) <= 4).all()
    assert bool((p.q.gather(1, p.candidates.unsqueeze(1)) > 0).all())
    # row k's distribution from the draft's scores and the drawn prefix, written out
    block = torch.full((6,), draft.mask_token_id)
    block[0] = prompt[-1]
    hidden = prop._hidden(block, prompt.shape[0] - 1)
    logits = prop._head_logits(hidden).float()
    prev = prompt[-1]
    for k in range(5):
        s, c = logits[k].topk(4)
        z = draft.selector.shift(hidden[k:k + 1], llama_target.embed(prev.view(1)))[0]
        q = torch.zeros(99)
        q[c] = (s + llama_target.lm_head.weight[c].float() @ z).softmax(-1)
        torch.testing.assert_close(p.q[k], q, rtol=1e-5, atol=1e-6)
        prev = p.candidates[k]


def test_selector_saved_beside_the_public_layout(llama_target, tmp_path):
    """model.safetensors keeps the public layout; the selector's file restores it exactly (fp32); a missing file is
    a clear error; a draft saved again without one leaves no stale file; training a draft further drops it."""
    from safetensors.torch import load_file

    draft = _selector_draft(llama_target)
    draft.save_pretrained(tmp_path / "d")
    assert not [k for k in load_file(str(tmp_path / "d" / "model.safetensors")) if "selector" in k]
    back = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert back.config.selector_rank == 6 and back.config.selector_top_k == 5
    assert back.selector.w_out.weight.dtype == torch.float32
    for k, v in draft.selector.state_dict().items():
        torch.testing.assert_close(back.selector.state_dict()[k], v, rtol=0, atol=0)
    (tmp_path / "d" / SELECTOR_WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="chain selector"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")
    draft.without_selector().save_pretrained(tmp_path / "d")
    assert not (tmp_path / "d" / SELECTOR_WEIGHTS_NAME).exists()
    assert DFlashDraftModel.from_pretrained(tmp_path / "d").selector is None


def _records(n: int, seed: int) -> list[dict]:
    # repetitive text, so that the token before a row says much about the row (something for a selector to learn)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(0, 40, (5,), generator=g).tolist()
        ids = (motif * 8)[: int(torch.randint(24, 40, (1,), generator=g))]
        out.append({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4)})
    return out


@pytest.fixture
def tiny_target() -> TargetModel:
    return TargetModel(tiny_llama(layers=5), ToyTokenizer())


def _fit(tmp_path, target, out: str, **kw):
    args = dict(draft=str(tmp_path / "draft"), cache=str(tmp_path / "tc"), heldout_cache=str(tmp_path / "held"),
                out_dir=str(tmp_path / out), rank=16, top_k=32, block=4, anchors=8, epochs=3, batch_rows=32, lr=1e-2,
                part_seqs=3, eval_seqs=4, eval_anchors=6)
    return train_selector(SelectorConfig(**{**args, **kw}), target, progress=False)


def test_selector_fit_learns_and_resumes_exactly(tiny_target, tmp_path):
    recs = _records(12, seed=3)
    build_teacher_cache(tiny_target, recs[:9], tmp_path / "tc", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs[9:], tmp_path / "held", [1, 3], topk=4)
    cfg = replace(tiny_draft(tiny_target, block_size=8).config, target_layer_ids=[1, 3])
    with seeded(2):
        DFlashDraftModel(cfg).save_pretrained(tmp_path / "draft")

    full = _fit(tmp_path, tiny_target, "a")
    log = [json.loads(x) for x in (tmp_path / "a" / "selector_log.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in log] == [0, 1, 2, 3]
    assert log[-1]["loss"] < log[1]["loss"], "the fit lowers its loss"
    # on its own training rows the fitted selector picks the greedy token more often than the draft's best column
    from blockdraft.train.selector import ROW_FIELDS, held_out_scores

    parts = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "a" / "rows").glob("part-*.pt"))]
    rows = {f: torch.cat([p[f] for p in parts]) for f in ROW_FIELDS}
    fitted = DFlashDraftModel.from_pretrained(tmp_path / "a" / "draft").selector
    head = tiny_target.lm_head.weight
    mine = held_out_scores(fitted, rows, head, tiny_target.embed, 4)
    base = held_out_scores(None, rows, head, tiny_target.embed, 4)
    assert mine["acc"][0] > base["acc"][0] + 0.1, (mine, base)

    # killed while collecting its rows: started again, the fit reuses the part written and ends with the same
    # weights (a kill during the fit resumes from the epoch's checkpoint in the same way)
    import blockdraft.train.selector as mod

    real = mod.collect_rows
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    mod.collect_rows = dying
    try:
        with pytest.raises(KeyboardInterrupt):
            _fit(tmp_path, tiny_target, "b")
    finally:
        mod.collect_rows = real
    assert len(list((tmp_path / "b" / "rows").glob("part-*.pt"))) == 1
    with pytest.raises(FileExistsError, match="another config"):
        _fit(tmp_path, tiny_target, "b", lr=2e-2)
    _fit(tmp_path, tiny_target, "b")
    a = DFlashDraftModel.from_pretrained(tmp_path / "a" / "draft")
    b = DFlashDraftModel.from_pretrained(tmp_path / "b" / "draft")
    for k, v in a.selector.state_dict().items():
        torch.testing.assert_close(b.selector.state_dict()[k], v, rtol=0, atol=0)
    assert a.config.extra["selector_training"]["rows"] == full["rows"]
