"""Training from teacher caches (train/teacher.py, train/blockattn.py, train/cached.py through the one loop in
train/trainer.py) on tiny random models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from blockdraft.models.target import TargetModel
from blockdraft.train.blockattn import block_forward, soft_cross_entropy
from blockdraft.train.blocks import block_attention_mask
from blockdraft.train.cached import frequent_greedy_tokens
from blockdraft.train.checkpoint import latest_checkpoint
from blockdraft.train.config import TrainConfig
from blockdraft.train.curve import evaluate
from blockdraft.train.batches import anchor_weights, make_batch, valid_anchors, DraftHead
from blockdraft.train.teacher import TeacherCache, build_teacher_cache
from blockdraft.train.live import TrainModule
from blockdraft.train.trainer import make_draft, train

from conftest import MASK_ID, VOCAB, ToyTokenizer, seeded, tiny_draft, tiny_llama


def make_fast_draft(cfg: TrainConfig, target, cache: TeacherCache):
    """The draft a cache-source run starts from (its reduced vocabulary counted on `cache`)."""
    return make_draft(cfg, target, lambda n: frequent_greedy_tokens(cache, n, target.vocab_size,
                                                                    target.eos_token_ids))


def _saved(run_dir) -> dict:
    """The newest checkpoint of a run: {"draft": its weights, "state": its training state}."""
    from safetensors.torch import load_file

    ckpt = latest_checkpoint(run_dir)
    return {"draft": load_file(str(ckpt / "draft.safetensors")),
            "state": json.loads((ckpt / "state.json").read_text())}


def _records(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = int(torch.randint(3, 8, (1,), generator=g))
        resp = int(torch.randint(10, 30, (1,), generator=g))
        ids = torch.randint(0, VOCAB - 2, (prompt + resp,), generator=g).tolist()
        out.append({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * prompt + [1] * resp})
    return out


@pytest.fixture
def tiny_target() -> TargetModel:
    return TargetModel(tiny_llama(layers=5), ToyTokenizer())


def test_block_forward_matches_dense_mask_reference(tiny_target):
    """The factorised block attention equals the dense-mask training forward, sequence by sequence, including a
    padded batch (sequences and anchor lists of different lengths). fp32; tolerance 1e-4 because the two paths sum
    the softmax in different orders."""
    draft = tiny_draft(tiny_target, layers=2, block_size=4).float()
    block = 4
    g = torch.Generator().manual_seed(3)
    lens, anchor_lists = [17, 11], [torch.tensor([2, 5, 9, 14]), torch.tensor([1, 6, 10])]
    feats = [torch.randn(1, L, 3 * 48, generator=g) for L in lens]
    block_ids = []
    refs = []
    for f, a in zip(feats, anchor_lists):
        ids = torch.randint(0, VOCAB - 2, (a.numel() * block,), generator=g)
        ids.view(-1, block)[:, 1:] = MASK_ID
        block_ids.append(ids)
        emb = tiny_target.embed(ids.unsqueeze(0))
        pos = (a[:, None] + torch.arange(block)).reshape(1, -1)
        mask = block_attention_mask(a, block, f.shape[1])[None, None]
        refs.append(TrainModule(draft)(f, emb, pos, mask))
    s, n, L = 2, 4, max(lens)
    fb = torch.zeros(s, L, 3 * 48)
    ab = torch.ones(s, n, dtype=torch.long)
    eb = torch.zeros(s, n * block, 48)
    for i in range(s):
        fb[i, : lens[i]] = feats[i][0]
        ab[i, : anchor_lists[i].numel()] = anchor_lists[i]
        eb[i, : block_ids[i].numel()] = tiny_target.embed(block_ids[i].unsqueeze(0))[0]
    out = block_forward(draft, fb, torch.tensor(lens), eb, ab, block)
    for i in range(s):
        rows = anchor_lists[i].numel() * block
        torch.testing.assert_close(out[i, :rows], refs[i], atol=1e-4, rtol=1e-4)


def test_teacher_cache_roundtrip_resume_and_spec_check(tiny_target, tmp_path):
    recs = _records(5, seed=0)
    out = tmp_path / "tc"
    build_teacher_cache(tiny_target, recs[:3], out, [1, 3], topk=4, chunk_records=2)
    build_teacher_cache(tiny_target, recs, out, [1, 3], topk=4, chunk_records=2)  # resumes after record 3
    cache = TeacherCache(out)
    assert [q.id for q in cache.sequences] == [r["id"] for r in recs]
    tiny_target.set_layer_ids([1, 3])
    for q, r in zip(cache.sequences, recs):
        ids = torch.tensor(r["input_ids"]).unsqueeze(0)
        hidden, feats = tiny_target.hidden(ids, None, tap=True)
        logits = tiny_target.logits(hidden)[0]
        assert q.tokens.tolist() == r["input_ids"] and q.loss_mask.tolist() == r["loss_mask"]
        assert q.greedy.tolist() == logits.argmax(-1).tolist()
        stored = torch.from_numpy(np.array(q.feats).view(np.int16)).view(torch.bfloat16).float()
        torch.testing.assert_close(stored, feats[0].to(torch.bfloat16).float())  # bf16 storage: exact after rounding
    assert cache.columns([3]).tolist() == list(range(48, 96))
    with pytest.raises(ValueError, match="asks for"):
        build_teacher_cache(tiny_target, recs, out, [1, 2], topk=4)
    with pytest.raises(ValueError, match="not \\[4\\]"):
        cache.columns([4])
    (out / "manifest.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        TeacherCache(out)



def test_int8_features_hold_the_bf16_ones_within_half_a_step(tiny_target, tmp_path):
    """An int8 cache holds each position's features as codes times max|x| / 127 per group of 32: read back, every
    value is within half a code step of the bf16 cache's (plus bf16's own rounding of the result), at half the bytes
    and a scale per group; a cache of one kind is not resumed as the other."""
    from blockdraft.train.teacher import feats_tensor

    recs = _records(3, seed=5)
    build_teacher_cache(tiny_target, recs, tmp_path / "b", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs, tmp_path / "q", [1, 3], topk=4, feats="int8")
    b, q = TeacherCache(tmp_path / "b"), TeacherCache(tmp_path / "q")
    assert q.feats == "int8" and b.feats == "bf16"
    for sb, sq in zip(b.sequences, q.sequences):
        assert np.asarray(sq.feats).dtype == np.int8 and np.asarray(sq.feats).nbytes * 2 == np.asarray(sb.feats).nbytes
        ref, got = feats_tensor(sb).float(), feats_tensor(sq).float()
        step = torch.from_numpy(np.array(sq.feats_scale)).repeat_interleave(32, dim=1)  # [L, K*H]
        assert ((got - ref).abs() <= step / 2 + ref.abs() * 2 ** -7 + 1e-6).all()
        cols = q.columns([3])  # one layer's columns read alone: the same values
        assert torch.equal(feats_tensor(sq, cols), feats_tensor(sq)[:, cols])
    with pytest.raises(ValueError, match="asks for"):
        build_teacher_cache(tiny_target, recs, tmp_path / "q", [1, 3], topk=4)


def test_a_cache_of_appended_records_is_the_tail_of_one_cache_of_all(tiny_target, tmp_path):
    recs = _records(5, seed=3)
    build_teacher_cache(tiny_target, recs, tmp_path / "all", [1, 3], topk=4, chunk_records=2)
    build_teacher_cache(tiny_target, recs[:2], tmp_path / "head", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs[2:], tmp_path / "tail", [1, 3], topk=4, first_record=2)
    whole = TeacherCache(tmp_path / "all").sequences
    parts = TeacherCache(tmp_path / "head").sequences + TeacherCache(tmp_path / "tail").sequences
    assert [q.id for q in parts] == [q.id for q in whole]
    for a, b in zip(parts, whole):
        assert a.greedy.tolist() == b.greedy.tolist() and np.array_equal(np.asarray(a.feats), np.asarray(b.feats))
    # resuming the tail's cache with records cut from elsewhere would mix two slices in one cache
    with pytest.raises(ValueError, match="first_record"):
        build_teacher_cache(tiny_target, recs[1:], tmp_path / "tail", [1, 3], topk=4, first_record=1)

def test_batch_labels_are_teacher_forced_greedy_tokens(tiny_target, tmp_path):
    recs = _records(2, seed=1)
    build_teacher_cache(tiny_target, recs, tmp_path / "tc", [1, 3], topk=4)
    cache = TeacherCache(tmp_path / "tc")
    q = cache.sequences[0]
    a = valid_anchors(q, 512)
    assert a.min() >= 1 and all(q.loss_mask[p] and q.loss_mask[p + 1] for p in a)
    b = make_batch([q], [a[:3]], 4, MASK_ID, cache.columns([1, 3]), 512, with_topk=True, chain=False)
    L = len(q)
    assert b.rows == 3 * 4
    for j, p in enumerate(a[:3].tolist()):
        assert b.block_ids[0, j * 4] == q.tokens[p] and (b.block_ids[0, j * 4 + 1: j * 4 + 4] == MASK_ID).all()
        for k in range(1, 4):
            want = int(q.greedy[p + k - 1]) if p + k < L and q.loss_mask[p + k] else -100
            assert int(b.labels[0, j * 4 + k]) == want
            if want >= 0:
                assert b.topk_ids[0, j * 4 + k].tolist() == q.topk_ids[p + k - 1].tolist()


def test_chain_labels_keep_only_rows_the_target_would_reach():
    """With chain labels, row k >= 2 of the block at anchor p keeps its label only if tokens p+1..p+k-1 are the
    target's own greedy choices; checked against a plain loop on a synthetic sequence where about half the text
    agrees with the target (random flips from a local generator)."""
    from blockdraft.train.teacher import TeacherSequence

    g = np.random.default_rng(11)
    L, block = 40, 5
    tokens = g.integers(0, VOCAB - 2, L).astype(np.int32)
    greedy = np.roll(tokens, -1).copy()  # greedy[t] = tokens[t+1]: the text is the target's own ...
    flip = g.random(L) < 0.4
    greedy[flip] = (greedy[flip] + 1) % (VOCAB - 2)  # ... except at the flipped positions
    mask = np.r_[np.zeros(3), np.ones(L - 3)].astype(np.uint8)
    q = TeacherSequence("s", tokens, mask, np.zeros((L, 6), np.uint16), greedy, np.zeros((L, 2), np.int32),
                        np.zeros((L, 2), np.float16))
    a = valid_anchors(q, 512)
    b = make_batch([q], [a], block, MASK_ID, np.arange(6), 512, with_topk=False, chain=True)
    kept = dropped = 0
    for j, p in enumerate(a.tolist()):
        for k in range(1, block):
            inside = p + k < L and mask[p + k]
            reached = all(tokens[p + i] == greedy[p + i - 1] for i in range(1, k))
            want = int(greedy[p + k - 1]) if inside and reached else -100
            assert int(b.labels[0, j * block + k]) == want, (p, k)
            kept += want >= 0
            dropped += inside and not reached
    assert kept > 20 and dropped > 20  # both cases occur, so the comparison above tests something


def test_training_draws_from_several_caches_with_their_own_layer_order(tiny_target, tmp_path):
    """Two training caches that store the run's layers in different column orders (one with an extra layer): a
    batch reads each sequence's own columns, and train-fast runs on their union."""
    recs = _records(8, seed=7)
    build_teacher_cache(tiny_target, recs[:3], tmp_path / "tc", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs[3:6], tmp_path / "tc2", [3, 2, 1], topk=4)
    build_teacher_cache(tiny_target, recs[6:], tmp_path / "held", [1, 3], topk=4)
    a, b2 = TeacherCache(tmp_path / "tc"), TeacherCache(tmp_path / "tc2")
    q2 = b2.sequences[0]
    an = valid_anchors(q2, 512)[:2]
    b = make_batch([q2], [an], 4, MASK_ID, [b2.columns([1, 3])], 512, with_topk=False)
    tiny_target.set_layer_ids([1, 3])
    _, feats = tiny_target.hidden(torch.tensor(recs[3]["input_ids"]).unsqueeze(0), None, tap=True)
    torch.testing.assert_close(b.features[0].float(), feats[0].to(torch.bfloat16).float())  # exact after bf16
    assert len(a) == 3
    cfg = _fast_cfg(tmp_path, cache=f"{tmp_path / 'tc'},{tmp_path / 'tc2'}", steps=3, eval_every=3)
    with seeded(0):
        last = train(cfg, tiny_target)
    assert last["step"] == 3


def _fast_cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(cache=str(tmp_path / "tc"), heldout_cache=str(tmp_path / "held"), out_dir=str(tmp_path / "run"),
                layer_ids=[1, 3], num_layers=2, init="random", block_size=4, anchors=6, seqs_per_step=2, steps=6,
                lr=3e-3, warmup=2, draft_vocab_size=40, eval_every=3, save_every=3, eval_seqs=3, eval_anchors=4,
                threads=1, kd_weight=0.5, mask_token_id=MASK_ID, gamma=7.0)
    base.update(kw)
    return TrainConfig(**base)


def test_soft_cross_entropy_ignores_columns_without_teacher_mass():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 7, generator=g)
    probs = torch.softmax(torch.randn(3, 6, generator=g), -1)
    # a copy gate's last column is -inf in rows without a candidate, and the teacher never puts mass there
    gated = torch.cat([logits[:, :6], torch.full((3, 1), float("-inf"))], 1).requires_grad_()
    dense = torch.cat([probs, torch.zeros(3, 1)], 1)
    loss = soft_cross_entropy(gated, dense)
    naive = -(probs * torch.log_softmax(logits[:, :6].double(), -1)).sum(-1)  # the same rows without that column
    torch.testing.assert_close(loss.double(), naive, atol=1e-5, rtol=0)  # fp32 log-softmax against fp64
    loss.sum().backward()
    assert torch.isfinite(gated.grad).all()


def test_distillation_with_a_copy_gate_trains_to_finite_weights(tiny_target, tmp_path):
    recs = _records(8, seed=6)
    build_teacher_cache(tiny_target, recs[:6], tmp_path / "tc", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs[6:], tmp_path / "held", [1, 3], topk=4)
    with seeded(0):
        train(_fast_cfg(tmp_path, copy_gate=True, kd_weight=0.5, steps=3, eval_every=3), tiny_target)
    curve = [json.loads(x) for x in (tmp_path / "run" / "curve.jsonl").read_text().splitlines()]
    assert all(np.isfinite(c["loss"]) for c in curve if "loss" in c) and any("loss" in c for c in curve)
    assert all(torch.isfinite(v).all() for v in _saved(tmp_path / "run")["draft"].values())


def test_train_fast_learns_resumes_exactly_and_writes_a_loadable_draft(tiny_target, tmp_path):
    recs = _records(8, seed=2)
    build_teacher_cache(tiny_target, recs[:6], tmp_path / "tc", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs[6:], tmp_path / "held", [1, 3], topk=4)
    with seeded(0):
        train(_fast_cfg(tmp_path), tiny_target)
    full = _saved(tmp_path / "run")
    curve = [json.loads(x) for x in (tmp_path / "run" / "curve.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [0, 3, 6] and all(len(c["acc"]) == 3 for c in curve)
    # a run stopped after 3 steps and resumed gives the same weights as the uninterrupted one
    with seeded(0):
        train(_fast_cfg(tmp_path, out_dir=str(tmp_path / "run2"), steps=6, minutes=1e-9), tiny_target)
    with seeded(0):
        train(_fast_cfg(tmp_path, out_dir=str(tmp_path / "run2")), tiny_target, resume=True)
    part = _saved(tmp_path / "run2")
    assert part["state"]["step"] == 6
    for k, v in full["draft"].items():
        torch.testing.assert_close(part["draft"][k], v, atol=0, rtol=0)
    from blockdraft.models.draft import DFlashDraftModel

    d = DFlashDraftModel.from_pretrained(tmp_path / "run" / "draft")
    assert d.config.target_layer_ids == [1, 3] and d.config.draft_vocab_size == 40


def _cached_draft(target, tmp_path, n_records: int, record_seed: int, draft_seed: int):
    """A teacher cache of random records (layers 1, 3) and a seeded random draft over the full vocabulary ->
    (cache, draft, head, cols)."""

    build_teacher_cache(target, _records(n_records, seed=record_seed), tmp_path / "tc", [1, 3], topk=4)
    cache = TeacherCache(tmp_path / "tc")
    with seeded(draft_seed):
        draft = make_fast_draft(_fast_cfg(tmp_path, draft_vocab_size=VOCAB), target, cache)
    return cache, draft, DraftHead(target, draft), cache.columns([1, 3])


def test_evaluate_implied_tau_matches_a_naive_count(tiny_target, tmp_path):
    """evaluate()'s tau is 1 + the mean accepted-prefix length, recomputed here row by row with a plain loop."""
    cache, draft, head, cols = _cached_draft(tiny_target, tmp_path, n_records=3, record_seed=4, draft_seed=5)
    anchors = [valid_anchors(q, 512)[:5] for q in cache.sequences]
    ev = evaluate(draft, tiny_target, head, cache.sequences, anchors, cols, 512)
    accepted = []
    for q, a in zip(cache.sequences, anchors):
        b = make_batch([q], [a], 4, MASK_ID, cols, 512, with_topk=False)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = block_forward(draft, b.features, b.ctx_len, tiny_target.embed(b.block_ids), b.anchors, 4)
            pred = head.ids[head.logits(h).float().argmax(-1)][0]
        for j in range(len(a)):
            n = 0
            for k in range(1, 4):
                if b.labels[0, j * 4 + k] < 0 or pred[j * 4 + k] != b.labels[0, j * 4 + k]:
                    break
                n += 1
            accepted.append(n)
    assert ev["tau4"] == pytest.approx(1 + sum(accepted) / len(accepted), abs=1e-4)


def test_sigterm_stops_after_a_step_checkpoints_and_exports(tiny_target, tmp_path):
    """SIGTERM during a run: the loop ends after the current step, a checkpoint and the draft are written, and
    --resume continues from that step."""
    import os
    import signal
    import threading

    recs = _records(8, seed=6)
    build_teacher_cache(tiny_target, recs[:6], tmp_path / "tc", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs[6:], tmp_path / "held", [1, 3], topk=4)
    cfg = _fast_cfg(tmp_path, steps=100_000, eval_every=100_000, save_every=100_000)
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with seeded(0):
            train(cfg, tiny_target)
    finally:
        timer.cancel()
    state = _saved(tmp_path / "run")["state"]
    assert 0 < state["step"] < 100_000
    assert (tmp_path / "run" / "draft" / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back
    with seeded(0):
        train(_fast_cfg(tmp_path, steps=state["step"] + 2), tiny_target, resume=True)
    assert _saved(tmp_path / "run")["state"]["step"] == state["step"] + 2


def test_bool_flags_parse_strictly():
    """TrainConfig's bool fields on the command line: 'false' must turn an option off (a plain str would be truthy)."""
    from blockdraft.cli import build_parser
    from blockdraft.train.config import parse_bool

    args = build_parser().parse_args(["train-fast", "--bucket", "false", "--chain-labels", "yes"])
    assert args.bucket is False and args.chain_labels is True
    with pytest.raises(ValueError, match="true or false"):
        parse_bool("maybe")


def test_recipes_load_as_fast_configs_and_flags_override_them(tmp_path):
    """Every shipped recipe names only TrainConfig fields with values of the fields' types; a flag given on the
    command line wins over the recipe; an unknown name is refused with the file's path."""
    from pathlib import Path

    from blockdraft.cli import build_parser
    from blockdraft.cli.train import cmd_train

    recipes = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        cfg = TrainConfig.from_yaml(path)
        assert isinstance(cfg.lr, float) and isinstance(cfg.steps, int)
        assert all(isinstance(i, int) for i in cfg.layer_ids)
    cfg = TrainConfig.from_yaml(recipes[0], lr=1e-3, steps=None)
    assert cfg.lr == 1e-3 and cfg.steps == TrainConfig.from_yaml(recipes[0]).steps
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 10\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="bad.yaml: unknown training options \\['learning_rate'\\]"):
        TrainConfig.from_yaml(bad)
    args = build_parser().parse_args(["train-fast", "--config", str(bad)])
    with pytest.raises(ValueError, match="unknown training options"):
        cmd_train(args)


def test_walk_tau_replays_greedy_decoding_like_a_plain_loop(tiny_target, tmp_path):
    """walk_tau over padded batches equals a per-sequence loop that predicts one block at a time at the anchors
    decoding would visit (start at the first response anchor, move past the accepted rows and the bonus token)."""
    from blockdraft.train.curve import walk_tau

    cache, draft, head, cols = _cached_draft(tiny_target, tmp_path, n_records=5, record_seed=8, draft_seed=9)
    got = walk_tau(draft, tiny_target, head, cache.sequences, cols, 512, block=3, batch_seqs=2)
    steps = committed = first = 0
    for q in cache.sequences:
        valid = set(valid_anchors(q, 512).tolist())
        p = min(valid)
        while p in valid:
            b = make_batch([q], [np.array([p])], 3, MASK_ID, cols, 512, with_topk=False)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                h = block_forward(draft, b.features, b.ctx_len, tiny_target.embed(b.block_ids), b.anchors, 3)
                pred = head.ids[head.logits(h).float().argmax(-1)][0]
            acc = 0
            for k in (1, 2):
                if b.labels[0, k] < 0 or pred[k] != b.labels[0, k]:
                    break
                acc += 1
            first += int(b.labels[0, 1] >= 0 and pred[1] == b.labels[0, 1])
            steps, committed, p = steps + 1, committed + acc + 1, p + acc + 1
    assert got["walk_steps"] == steps and steps > 20
    assert committed > steps  # some rows were accepted, so the walk's skipping ahead is exercised too
    assert got["walk_tau"] == pytest.approx(committed / steps, abs=1e-4)
    assert got["walk_acc1"] == pytest.approx(first / steps, abs=1e-4)


def test_a_continued_draft_may_gain_taps_and_layers_but_not_lose_taps(tiny_target, tmp_path):
    """init=DIR with more layer ids or layers than the saved draft extends it (function kept: draft.py's test);
    a run that drops a layer the draft reads is refused, before any training."""

    cache, draft, _, _ = _cached_draft(tiny_target, tmp_path, 3, record_seed=4, draft_seed=1)
    draft.save_pretrained(tmp_path / "saved")
    wider = make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved"), layer_ids=[1, 2, 3], num_layers=3),
                            tiny_target, cache)
    assert wider.config.target_layer_ids == [1, 2, 3] and wider.config.num_hidden_layers == 3 and wider.training
    with pytest.raises(ValueError, match="may only gain layers"):
        make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved"), layer_ids=[3]), tiny_target, cache)
    nxt = make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved"), next_token_feature=True), tiny_target,
                          cache)
    assert nxt.config.next_token_feature and not nxt.fc.weight[:, -tiny_target.hidden_size:].any()
    nxt.save_pretrained(tmp_path / "saved-nxt")
    with pytest.raises(ValueError, match="next-token-feature"):  # dropping the input would change the function
        make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved-nxt")), tiny_target, cache)
    gated = make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved"), copy_gate=True), tiny_target, cache)
    assert gated.config.copy_gate and not gated.copy_gate.table.any() and not gated.copy_gate.w.any()
    gated.save_pretrained(tmp_path / "saved-gate")
    with pytest.raises(ValueError, match="copy-gate"):
        make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved-gate")), tiny_target, cache)
    mixed = make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved"), layer_mix=True), tiny_target, cache)
    assert mixed.config.layer_mix and bool((mixed.mix == 1).all())
    mixed.save_pretrained(tmp_path / "saved-mix")
    with pytest.raises(ValueError, match="layer-mix"):
        make_fast_draft(_fast_cfg(tmp_path, init=str(tmp_path / "saved-mix")), tiny_target, cache)


@pytest.mark.parametrize("next_token,copy_gate,layer_mix", [(False, False, False), (True, False, False),
                                                            (False, True, False), (False, False, True)],
                         ids=["layout", "next-token-feature", "copy-gate", "layer-mix"])
def test_walk_on_the_engines_own_text_replays_its_decoding(tiny_target, tmp_path, next_token, copy_gate, layer_mix,
                                                          monkeypatch):
    """Training's replay (walk_lengths) and the engine's real decoding agree: on the text the engine wrote, the walk
    visits the same anchors and commits the same tokens per step. This ties the learning curve to what decoding
    will do (the training side's batched block attention over cached features vs the engine's KV-cached proposer;
    with `next_token_feature`, also the two ways of pairing each context position with the token after it; with a
    copy gate, training's lookup table against decoding's per-step lookup and the two scorings; with a layer mix,
    training's per-input projections against decoding's scaled fusion).
    The draft is trained for a few steps on the target's own text first, so that blocks get accepted. fp32 on both
    sides; the cache keeps features rounded to bf16, so a near-tie may flip a step: at most 1 in 10 may differ."""
    from blockdraft.config import GenerationConfig
    from blockdraft.models.ngram import lookup_continuation, lookup_table
    from blockdraft.models.draft import DFlashDraftModel
    from blockdraft.decode.engine import Engine
    from blockdraft.decode.proposers.dflash import DFlashProposer
    from blockdraft.train.curve import walk_lengths

    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, VOCAB - 2, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    cfg = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    plain = Engine(tiny_target, None)
    records = []
    for i, p in enumerate(prompts):
        new = plain.generate(p, cfg).token_ids
        records.append({"id": f"g{i}", "input_ids": p + new, "loss_mask": [0] * len(p) + [1] * len(new)})
    build_teacher_cache(tiny_target, records, tmp_path / "own", [1, 3], topk=4)
    own = str(tmp_path / "own")
    with seeded(15):
        train(_fast_cfg(tmp_path, cache=own, heldout_cache=own, steps=40, anchors=0, kd_weight=0.0,
                             draft_vocab_size=VOCAB, eval_every=1000, save_every=1000, walk_seqs=0,
                             next_token_feature=next_token, copy_gate=copy_gate, layer_mix=layer_mix), tiny_target)
    draft = DFlashDraftModel.from_pretrained(tmp_path / "run" / "draft", dtype=torch.float32).eval()
    assert draft.config.next_token_feature == next_token and draft.config.copy_gate == copy_gate
    assert draft.config.layer_mix == layer_mix
    if layer_mix:  # trained at its own rate: the two layers read the two taps differently
        mix = draft.mix.detach()
        assert float((mix - 1).abs().min()) > 0.02 and float((mix[0] - mix[1]).abs().max()) > 0.02, mix
    real, seen = [], []
    if copy_gate:  # trained (its own learning rate), so a misaligned candidate would change the proposals; random
        #            text repeats 1- and 2-grams only, so only those rows of the table move
        assert float(draft.copy_gate.table.detach()[:2, 1:4].abs().min()) > 0.02
        with torch.no_grad():  # random text rarely repeats: raise the bonus so that candidates decide many rows
            draft.copy_gate.table.add_(3.0)
        import blockdraft.decode.proposers.dflash as dflash_module

        def recording(tokens, num, *a, **kw):
            cont, n = lookup_continuation(tokens, num, *a, **kw)
            seen.append((len(real), tokens.numel(), num, cont.tolist(), n))
            return cont, n

        monkeypatch.setattr(dflash_module, "lookup_continuation", recording)
    if next_token:  # the input was trained, so a misaligned next token would change the proposals
        assert float(draft.fc.weight.detach()[:, -draft.config.hidden_size:].abs().sum()) > 0
    eng = Engine(tiny_target, DFlashProposer(draft, tiny_target, block_size=4))
    for p, rec in zip(prompts, records):
        res = eng.generate(p, cfg)
        assert p + res.token_ids == rec["input_ids"]  # lossless: the walk replays the same text
        real.append(res.stats.accept_lengths)
    real_steps = [a for r in real for a in r]
    cache = TeacherCache(tmp_path / "own")
    walked = walk_lengths(draft, tiny_target, DraftHead(tiny_target, draft), cache.sequences, cache.columns([1, 3]),
                          512, block=4, dtype=torch.float32)
    # the last step of each may differ: decoding stops at max_new_tokens, the walk at the end of the text
    pairs = [(w[0], r) for seq_w, seq_r in zip(walked, real) for w, r in zip(seq_w[:-1], seq_r[:-1])]
    assert len(pairs) > 30 and sum(r > 1 for _, r in pairs) >= 10  # drafts were accepted: the skipping is tested
    assert sum(w != r for w, r in pairs) <= len(pairs) // 10, pairs
    if copy_gate:  # the candidates decoding scored at every step are the training table's rows at that anchor
        # (a generation's last step drafts nothing when one token is left to write)
        assert len(real_steps) - len(prompts) <= len(seen) <= len(real_steps)
        for i, length, num, cont, n in seen:
            tab, nt = lookup_table(np.asarray(records[i]["input_ids"]), 3)
            assert n == nt[length - 1] and cont == [x for x in tab[length - 1, :num] if x >= 0], (i, length)


def test_batch_next_ids_are_the_tokens_after_each_position(tiny_target, tmp_path):
    """make_batch's next_ids[i, t] is token t+1 of sequence i (0 past its end), and fused_inputs appends their
    embeddings after the features only for a draft with next_token_feature."""
    from blockdraft.train.batches import fused_inputs

    cache, draft, _, cols = _cached_draft(tiny_target, tmp_path, n_records=3, record_seed=16, draft_seed=17)
    seqs = cache.sequences
    b = make_batch(seqs, [valid_anchors(q, 512)[:3] for q in seqs], 4, MASK_ID, cols, 512, with_topk=False)
    for i, q in enumerate(seqs):
        toks = np.asarray(q.tokens, dtype=np.int64)
        assert b.next_ids[i, : len(toks) - 1].tolist() == toks[1:].tolist()
        assert not b.next_ids[i, len(toks) - 1:].any()
    assert fused_inputs(draft, tiny_target, b) is b.features
    wide = draft.with_next_token_feature()
    got = fused_inputs(wide, tiny_target, b)
    h = tiny_target.hidden_size
    assert torch.equal(got[..., :-h], b.features.to(got.dtype))
    assert torch.equal(got[..., -h:], tiny_target.embed(b.next_ids).to(got.dtype))
    scaled = fused_inputs(draft.with_next_token_feature(scale=3.0), tiny_target, b)
    assert torch.equal(scaled[..., -h:], 3.0 * tiny_target.embed(b.next_ids).to(got.dtype))


def test_precision_reaches_the_training_step_and_auto_follows_the_cpu(tiny_target, tmp_path, monkeypatch):
    from blockdraft.train import precision

    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    assert precision.compute_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    assert precision.compute_dtype("auto") == torch.float32
    with pytest.raises(ValueError, match="precision"):
        precision.compute_dtype("fp16")
    recs = _records(8, seed=2)
    build_teacher_cache(tiny_target, recs[:6], tmp_path / "tc", [1, 3], topk=4)
    build_teacher_cache(tiny_target, recs[6:], tmp_path / "held", [1, 3], topk=4)
    weights = {}
    for name, prec in (("a", "fp32"), ("b", "fp32"), ("c", "bf16")):
        with seeded(0):
            train(_fast_cfg(tmp_path, out_dir=str(tmp_path / name), steps=2, precision=prec), tiny_target)
        weights[name] = _saved(tmp_path / name)["draft"]
    # fp32 is deterministic; bf16 autocast rounds the matmuls, so the same seeded steps land elsewhere
    for k, v in weights["a"].items():
        torch.testing.assert_close(weights["b"][k], v, atol=0, rtol=0)
    assert any(not torch.equal(weights["c"][k], v) for k, v in weights["a"].items())


def test_anchor_weights_follow_the_targets_hesitation(tiny_target, tmp_path):
    """anchor_weights: a distribution over the anchors, uniform at bias 0, and at bias b each anchor p weighs
    1 + b * (1 - P(token p)) with P the softmax of the cached top-k logits at p - 1 (a token outside them: P = 0);
    a run with the bias trains, and the bias is refused where it means nothing."""
    from blockdraft.train.teacher import TeacherSequence

    g = np.random.default_rng(4)
    n, k = 12, 4
    topk_ids = np.stack([g.permutation(30)[:k] for _ in range(n)]).astype(np.int32)
    topk_logits = np.sort(g.normal(size=(n, k)) * 2, axis=1)[:, ::-1].astype(np.float16)
    tokens = g.integers(30, 40, size=n).astype(np.int32)  # outside every top-k ...
    for p, j in [(2, 0), (3, 1), (5, 3), (8, 0), (9, 2)]:
        tokens[p] = topk_ids[p - 1, j]  # ... except these: the target's j-th choice at p - 1
    seq = TeacherSequence("s", tokens, np.ones(n, np.uint8), np.zeros((n, 2), np.uint16), tokens, topk_ids,
                          topk_logits)
    a = valid_anchors(seq, 512)
    np.testing.assert_allclose(anchor_weights(seq, a, 0.0), np.full(len(a), 1 / len(a)))
    want = []
    for p in a:
        lg = topk_logits[p - 1].astype(np.float64)
        e = np.exp(lg - lg.max())
        hit = [j for j in range(k) if topk_ids[p - 1, j] == tokens[p]]
        want.append(1 + 3.0 * (1 - (e[hit[0]] / e.sum() if hit else 0.0)))
    w = anchor_weights(seq, a, 3.0)
    np.testing.assert_allclose(w, np.array(want) / sum(want), rtol=1e-12)
    assert w[list(a).index(2)] < w[list(a).index(4)]  # the target's first choice weighs less than a token outside

    build_teacher_cache(tiny_target, _records(6, seed=9), tmp_path / "tc", [1, 3], topk=4)
    with seeded(0):
        last = train(_fast_cfg(tmp_path, heldout_cache=str(tmp_path / "tc"), anchors=5, anchor_bias=4.0, steps=2,
                               eval_every=2), tiny_target)
    assert last["step"] == 2
    with pytest.raises(ValueError, match="anchor_bias"):
        _fast_cfg(tmp_path, anchor_bias=-1.0)
    with pytest.raises(ValueError, match="anchor_bias"):
        TrainConfig(data="x.jsonl", anchor_bias=2.0)


def test_param_groups_give_the_gate_and_the_mix_their_own_rates(tiny_target):
    """Every trainable parameter is in exactly one group; the gate's table and the layer mix have their own roles
    and rates (the mix at mix_lr_scale times the draft's schedule, the gate constant after warm-up)."""
    from blockdraft.train.trainer import draft_param_groups, group_lr

    draft = tiny_draft(tiny_target, layers=2, layer_mix=True).with_copy_gate()
    groups = draft_param_groups(draft)
    assert [g["role"] for g in groups] == ["draft", "gate", "mix"]
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in draft.parameters() if p.requires_grad) and len(set(ids)) == len(ids)
    assert groups[2]["params"] == [draft.mix] and groups[1]["params"] == [draft.copy_gate.table]
    cfg = TrainConfig(cache="x", steps=100, warmup=10, lr=1e-3, mix_lr_scale=7.0, copy_gate_lr=0.05)
    for step in (0, 5, 50, 99):
        assert group_lr("mix", step, cfg) == pytest.approx(7.0 * group_lr("draft", step, cfg))
    assert group_lr("gate", 50, cfg) == group_lr("gate", 99, cfg) == 0.05
    assert [g["role"] for g in draft_param_groups(tiny_draft(tiny_target))] == ["draft"]
    with pytest.raises(ValueError, match="mix_lr_scale"):
        TrainConfig(cache="x", mix_lr_scale=0.0)
