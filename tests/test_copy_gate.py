"""The copy gate (copy_gate.py): lookup candidates for every prefix, the gated scores against a naive reference,
losslessness through the engine, the public layout kept on disk, and training's view equal to decoding's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.models.copy_gate import (GATE_WEIGHTS_NAME, CopyGate, LookupTables, gated_ids, gated_logits,
                                  gated_probs_to_vocab)
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.draft_config import DFlashConfig
from blockdraft.decode.engine import Engine
from blockdraft.decode.proposers.dflash import DFlashProposer
from blockdraft.models.ngram import lookup_continuation, lookup_table
from conftest import naive_greedy, seeded, tiny_draft

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lookup_table_rows_equal_lookup_continuation_of_each_prefix():
    """The one-pass table (training) against the per-prefix search decoding runs (the naive reference)."""
    g = np.random.default_rng(0)
    for _ in range(150):
        L = int(g.integers(1, 40))
        toks = g.integers(0, int(g.integers(2, 6)), L)  # small alphabets: many repeats and competing matches
        cont, n = lookup_table(toks, 4)
        for p in range(L):
            want, m = lookup_continuation(torch.tensor(toks[: p + 1]), 4)
            assert n[p] == m and [x for x in cont[p] if x >= 0] == want.tolist(), (toks, p)


def test_lookup_tables_rows_follow_the_batch_layout():
    """Row k of the block at anchor p holds token k of p's continuation; row 0, padding anchors and rows past a
    short continuation hold -1 and match length 0."""
    class Seq:
        def __init__(self, t):
            self.tokens = np.asarray(t)

    seqs = [Seq([5, 6, 7, 5, 6, 7, 8]), Seq([1, 2, 1, 2])]
    anchors = [np.array([4, 5]), np.array([2])]
    cand, n = LookupTables(3).rows(seqs, anchors, 4, 512)
    assert cand.shape == n.shape == (2, 8)
    # seq 0, anchor 4 (prefix 5 6 7 5 6): "5 6" matched at 0 -> 7 5 6; anchor 5 (.. 5 6 7): "5 6 7" -> 5 6 7
    assert cand[0].tolist() == [-1, 7, 5, 6, -1, 5, 6, 7] and n[0].tolist() == [0, 2, 2, 2, 0, 3, 3, 3]
    # seq 1, anchor 2 (prefix 1 2 1): "1" at 0 -> 2, 1 (the continuation stops at the prefix's end); one anchor only
    assert cand[1].tolist() == [-1, 2, 1, -1, -1, -1, -1, -1] and n[1].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_gated_scores_equal_a_naive_per_row_reference(softcap):
    """Each row's scores, as a {target id: score} map, equal the head's logit of every draft-vocabulary token with
    the bonus added to the candidate's, plus the candidate itself when it lies outside that vocabulary; the
    probabilities mapped back to the target vocabulary are that map's softmax."""
    g = torch.Generator().manual_seed(3)
    V, H, R, B = 23, 7, 9, 5
    head = torch.randn(V, H, generator=g)
    vocab_ids = torch.tensor([0, 2, 3, 7, 11, 12, 19])
    vmap = torch.full((V,), -1, dtype=torch.long)
    vmap[vocab_ids] = torch.arange(len(vocab_ids))
    hidden = torch.randn(R, H, generator=g)
    gate = CopyGate(H, B)
    with torch.no_grad():
        gate.table.copy_(torch.randn(3, B, generator=g) * 2)
        gate.w.copy_(torch.randn(H, generator=g))
    cand = torch.tensor([-1, 2, 5, 19, 22, 3, -1, 8, 11])  # none, inside, outside, ...
    n = torch.tensor([1, 1, 2, 3, 3, 2, 1, 1, 2])
    k = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1])
    full = hidden @ head.T
    if softcap:
        full = torch.tanh(full / softcap) * softcap
    scores = gated_logits(full[:, vocab_ids], hidden, gate, cand, n, k, head, vmap, softcap=softcap)
    assert scores.shape == (R, len(vocab_ids) + 1)
    for r in range(R):
        want = {int(t): float(full[r, t]) for t in vocab_ids}
        c = int(cand[r])
        if c >= 0:
            want[c] = float((full[r, c] + gate.table[n[r] - 1, k[r]] + hidden[r] @ gate.w).detach())
        got = {}
        for col in range(scores.shape[1]):
            if scores[r, col] > float("-inf"):
                tid = int(gated_ids(torch.tensor(col), cand[r], vocab_ids, len(vocab_ids)))
                got[tid] = float(scores[r, col].detach())
        assert got.keys() == want.keys()
        for t in want:  # fp32 sums in a different order: 1e-5 relative
            assert got[t] == pytest.approx(want[t], rel=1e-5, abs=1e-5)
        probs = gated_probs_to_vocab(scores[r: r + 1].softmax(-1), cand[r: r + 1], vocab_ids, V)[0]
        ref = torch.zeros(V)
        ids = torch.tensor(list(want))
        ref[ids] = torch.tensor([want[int(t)] for t in ids]).softmax(-1)
        torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-6)


def _gated(target, seed=5, bonus=6.0, vocab=None):
    """A tiny draft with a copy gate that strongly favours lookup candidates (so they are proposed and verified)."""
    draft = tiny_draft(target, block_size=8, seed=seed)
    if vocab is not None:
        cfg = DFlashConfig(**{**draft.config.__dict__, "draft_vocab_size": len(vocab), "extra": {}})
        with seeded(seed):
            draft = DFlashDraftModel(cfg).eval()
        draft.set_draft_vocab(vocab)
    draft = draft.with_copy_gate().eval()
    with torch.no_grad():
        draft.copy_gate.table.fill_(bonus)
    return draft


def _start(prop, target, ids):
    """What the engine does before the first proposal: prefill all but the last token, tapping the draft's layers."""
    target.set_layer_ids(prop.layer_ids)
    prop.start(ids[:-1], target(ids[:-1].unsqueeze(0), None).features)


def _repetitive_prompt():
    return torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7])


@pytest.mark.parametrize("vocab", [None, "reduced"])
def test_greedy_with_a_copy_gate_is_token_exact(target, vocab):
    """Greedy output stays the target's with an active gate (most candidates outside a reduced vocabulary)."""
    prompt = _repetitive_prompt()
    ref = naive_greedy(target, prompt, 40)
    ids = torch.arange(0, 99, 4) if vocab else None  # 25 tokens: most candidates lie outside
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    res = Engine(target, DFlashProposer(_gated(target, vocab=ids), target, block_size=4)).generate(
        prompt, cfg)
    assert res.token_ids == ref


@pytest.mark.parametrize("vocab", [None, "reduced"])
def test_a_dominant_bonus_proposes_the_lookup_continuation(llama_target, vocab):
    """With a bonus far above any logit, the proposal is prompt lookup's continuation where there is one (also
    for tokens outside a reduced vocabulary: the extra column maps back to the candidate), and the draft's own
    choice in the rows past it."""
    ids = torch.arange(0, 99, 4) if vocab else None
    prompt = _repetitive_prompt()[:-1]  # ... 12 5 6: "5 6" matched at 5 -> 7 8 9 10 11 5 6, cut by num_draft
    draft = _gated(llama_target, vocab=ids, bonus=1e4)
    prop = DFlashProposer(draft, llama_target, block_size=8)
    _start(prop, llama_target, prompt)
    got = prop.propose(prompt, 7, SamplingParams(), None).candidates
    cont, n = lookup_continuation(prompt, 7)
    assert n == 2 and got.tolist() == cont.tolist()
    short = torch.tensor([3, 4, 3])  # "3" at 0 -> 4 3 (cut at the prefix's end): rows 3.. are the draft's
    plain = DFlashProposer(_gated(llama_target, vocab=ids, bonus=0.0), llama_target, block_size=8)
    for p in (prop, plain):
        _start(p, llama_target, short)
    a = prop.propose(short, 5, SamplingParams(), None).candidates
    b = plain.propose(short, 5, SamplingParams(), None).candidates
    assert a[:2].tolist() == [4, 3] and a[2:].tolist() == b[2:].tolist()


def test_zero_gate_proposes_what_the_draft_alone_proposes(llama_target):
    """A gate whose bonus is zero leaves every draft-vocabulary score as it was (full vocabulary: the same
    proposals, greedy)."""
    draft = tiny_draft(llama_target, block_size=8, seed=5)
    gated = draft.with_copy_gate().eval()
    prompt = _repetitive_prompt()
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    a = Engine(llama_target, DFlashProposer(draft, llama_target, block_size=4)).generate(prompt, cfg)
    b = Engine(llama_target, DFlashProposer(gated, llama_target, block_size=4)).generate(prompt, cfg)
    assert a.token_ids == b.token_ids and a.stats.accept_lengths == b.stats.accept_lengths


def test_sampled_proposals_carry_the_distribution_they_were_drawn_from(llama_target):
    """At T > 0 rejection sampling needs q: each row sums to one over the target vocabulary, the drawn token has
    mass, and an out-of-vocabulary candidate's mass sits on that candidate."""
    ids = torch.arange(0, 99, 4)
    draft = _gated(llama_target, vocab=ids, bonus=4.0)
    prompt = _repetitive_prompt()
    prop = DFlashProposer(draft, llama_target, block_size=6)
    _start(prop, llama_target, prompt)
    p = prop.propose(prompt, 5, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert p.q.shape == (5, 99)
    torch.testing.assert_close(p.q.sum(-1), torch.ones(5))
    assert bool((p.q.gather(1, p.candidates.unsqueeze(1)) > 0).all())
    cont, _ = lookup_continuation(prompt, 5)  # 8 9 5 6 7: 9 and 5 lie outside the 25-token vocabulary
    outside = [i for i, t in enumerate(cont.tolist()) if t % 4]
    assert outside and all(float(p.q[i, cont[i]]) > 0 for i in outside)


def test_gate_saved_beside_the_public_layout(llama_target, tmp_path):
    """model.safetensors keeps the public layout (no gate tensors); the gate file restores the values exactly;
    a missing gate file is a clear error; saving a gateless draft into the same folder removes a stale gate."""
    from safetensors.torch import load_file

    draft = _gated(llama_target, bonus=2.5)
    with torch.no_grad():
        draft.copy_gate.w.copy_(torch.linspace(-1, 1, draft.config.hidden_size))
    draft.save_pretrained(tmp_path / "d")
    assert not [k for k in load_file(str(tmp_path / "d" / "model.safetensors")) if "copy_gate" in k]
    back = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert back.config.copy_gate and back.copy_gate.table.dtype == torch.float32
    torch.testing.assert_close(back.copy_gate.table, draft.copy_gate.table, rtol=0, atol=0)
    torch.testing.assert_close(back.copy_gate.w, draft.copy_gate.w, rtol=0, atol=0)
    (tmp_path / "d" / GATE_WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="copy gate"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")
    draft.save_pretrained(tmp_path / "d")
    layout = back.without_copy_gate()  # what other engines run: the same weights, no gate
    assert layout.copy_gate is None and not layout.config.copy_gate
    for k, v in layout.state_dict().items():
        torch.testing.assert_close(v, back.state_dict()[k], rtol=0, atol=0)
    tiny_draft(llama_target).save_pretrained(tmp_path / "d")
    assert not (tmp_path / "d" / GATE_WEIGHTS_NAME).exists()
    assert not DFlashDraftModel.from_pretrained(tmp_path / "d").config.copy_gate


@pytest.mark.parametrize("vocab", [None, "reduced"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_top_tokens_are_the_largest_entries_of_the_dense_distribution(llama_target, vocab, temperature):
    """`distributions_top` reads each row's k best tokens from the draft's own columns (a reduced vocabulary, the
    gate's extra column) instead of a topk over the target's vocabulary: the same tokens with the same
    probabilities as the dense rows' topk, here with candidates inside and outside a reduced vocabulary and rows
    with fewer than k tokens of mass; and the dense rows are what `distributions` returns."""
    ids = torch.arange(0, 99, 4) if vocab else None
    draft = _gated(llama_target, vocab=ids, bonus=3.0)
    prompt = _repetitive_prompt()
    sampling = SamplingParams(temperature=temperature, top_k=7 if temperature else 0)
    prop = DFlashProposer(draft, llama_target, block_size=6)
    _start(prop, llama_target, prompt)
    q, (vals, toks) = prop.distributions_top(prompt, 5, sampling, 10)
    prop = DFlashProposer(draft, llama_target, block_size=6)
    _start(prop, llama_target, prompt)
    torch.testing.assert_close(prop.distributions(prompt, 5, sampling), q, rtol=0, atol=0)
    assert vals.shape == toks.shape == (5, 10)
    ref_vals, ref_toks = q.topk(10, dim=-1)
    torch.testing.assert_close(vals, ref_vals, rtol=0, atol=0)
    # past a row's support the zero-mass entries name arbitrary tokens on both sides (the gate's unused column
    # even names its row's candidate again): a tree never grows a node from them
    has_mass = vals > 0
    assert torch.equal(toks[has_mass], ref_toks[has_mass])
    assert torch.equal(q.gather(1, toks)[has_mass], vals[has_mass])
    if temperature:
        assert not bool(has_mass.all())  # top-k 7 leaves rows with fewer than 10 tokens of mass
