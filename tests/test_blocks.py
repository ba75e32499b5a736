"""Anchors, labels and the sparse training mask on hand-written cases, and batched-vs-naive equality."""

import torch

from blockdraft.train.blocks import (IGNORE, block_attention_mask, build_blocks, default_gamma, loss_weights,
                                     sample_anchors, valid_anchor_positions)
from blockdraft.train.live import TrainModule
from conftest import MASK_ID, tiny_draft

M = MASK_ID


def test_valid_anchors_need_two_response_tokens():
    lm = torch.tensor([0, 0, 1, 1, 1, 0, 1])
    assert valid_anchor_positions(lm).tolist() == [2, 3]


def test_blocks_labels_and_positions():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    lm = torch.tensor([0, 0, 1, 1, 1, 1])
    bb = build_blocks(ids, lm, torch.tensor([2, 4]), block_size=3, mask_token_id=M)
    assert bb.block_ids.tolist() == [12, M, M, 14, M, M]
    assert bb.positions.tolist() == [2, 3, 4, 4, 5, 6]
    # row k of the block at p predicts the token at p + k; row 0 and rows past the end have no label
    assert bb.labels.tolist() == [IGNORE, 13, 14, IGNORE, 15, IGNORE]
    assert bb.offsets.tolist() == [0, 1, 2, 0, 1, 2]


def test_mask_context_before_anchor_own_block_only():
    mask = block_attention_mask(torch.tensor([1, 3]), block_size=2, context_len=4)
    T, F = True, False
    assert mask.tolist() == [
        # ctx 0..3        block0  block1
        [T, F, F, F, T, T, F, F],
        [T, F, F, F, T, T, F, F],
        [T, T, T, F, F, F, T, T],
        [T, T, T, F, F, F, T, T],
    ]


def test_anchor_sampling_random_and_uniform():
    lm = torch.tensor([0] * 5 + [1] * 40)
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(lm, 8, 16, g)
    assert a.numel() == 8 and a.unique().numel() == 8 and bool((a >= 5).all()) and bool((a <= 43).all())
    assert torch.equal(a, a.sort().values)
    u = sample_anchors(lm, 100, 16, g, uniform=True)
    assert u.tolist() == [5, 21, 37]
    assert sample_anchors(torch.tensor([0, 0, 1]), 4, 4, g).numel() == 0


def test_loss_weights_decay():
    w = loss_weights(torch.tensor([0, 1, 2, 8]), gamma=7.0)
    assert w[0] == 0 and w[1] == 1.0
    torch.testing.assert_close(w[2], torch.exp(torch.tensor(-1 / 7.0)))
    assert loss_weights(torch.tensor([0, 3]), None).tolist() == [0.0, 1.0]
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def test_batched_mask_equals_each_block_run_alone_through_inference_path(target):
    """The training forward (all blocks at once, sparse mask) gives the same hidden states as running each block
    alone the way decoding does: context = features of positions < anchor, block at its true positions."""
    draft = tiny_draft(target, layers=2, block_size=4)
    seq = 20
    ids = torch.randint(0, 90, (seq,), generator=torch.Generator().manual_seed(0))
    lm = torch.tensor([0] * 6 + [1] * 14)
    target.set_layer_ids(draft.config.target_layer_ids)
    feats = target(ids.unsqueeze(0), None).features
    anchors = torch.tensor([6, 7, 11, 17])
    bb = build_blocks(ids, lm, anchors, 4, MASK_ID)
    mask = block_attention_mask(anchors, 4, seq)[None, None]
    hidden = TrainModule(draft)(feats, target.embed(bb.block_ids.unsqueeze(0)), bb.positions.unsqueeze(0), mask)
    for j, p in enumerate(anchors.tolist()):
        ks, vs = draft.context_kv(feats[:, :p], torch.arange(p).unsqueeze(0))
        rows = slice(4 * j, 4 * j + 4)
        alone = draft(target.embed(bb.block_ids[rows].unsqueeze(0)), bb.positions[rows].unsqueeze(0), ks, vs)
        # fp32, same maths: one masked attention over all blocks vs one block at a time sums in another order
        torch.testing.assert_close(hidden[rows], alone[0], atol=1e-5, rtol=1e-4)


def test_flex_block_mask_equals_the_dense_mask(llama_target):
    """The flex-attention path (used on GPUs) computes the same hidden states as the dense SDPA mask."""
    import warnings

    from blockdraft.train.blocks import flex_block_mask

    draft = tiny_draft(llama_target, layers=2, block_size=4)
    ids = torch.randint(0, 90, (20,), generator=torch.Generator().manual_seed(1))
    lm = torch.tensor([0] * 5 + [1] * 15)
    llama_target.set_layer_ids(draft.config.target_layer_ids)
    feats = llama_target(ids.unsqueeze(0), None).features
    anchors = torch.tensor([5, 9, 12, 18])
    bb = build_blocks(ids, lm, anchors, 4, MASK_ID)
    embeds, pos = llama_target.embed(bb.block_ids.unsqueeze(0)), bb.positions.unsqueeze(0)
    with torch.no_grad(), warnings.catch_warnings():  # flex has no CPU backward; its eager CPU form warns
        warnings.simplefilter("ignore")
        dense = TrainModule(draft)(feats, embeds, pos, block_attention_mask(anchors, 4, 20)[None, None])
        flex = TrainModule(draft)(feats, embeds, pos, flex_block_mask(anchors, 4, 20))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-4)  # fp32; two attention kernels, two summation orders
