"""Training: loss goes down, a trained draft beats an untrained one on held-out text, exact resume, data errors,
online and offline features give the same batches."""

import json

import pytest
import torch

from blockdraft.models.target import TargetModel
from blockdraft.train.features import OfflineFeatures, OnlineFeatures, precompute_features
from blockdraft.train.config import TrainConfig
from blockdraft.train.live import TrainModule, evaluate_tau, frequent_tokens, prompt_of, sample_loss
from blockdraft.train.records import load_records
from blockdraft.train.trainer import make_draft, train
from conftest import MASK_ID, seeded, tiny_llama


@pytest.fixture(scope="module")
def tiny():
    # init 0.05: greedy text with short repeating motifs, which a tiny draft can learn in a few hundred steps
    # (a chaotic init-0.5 target gives text no 1-layer draft predicts, so the tau test would measure nothing)
    return TargetModel(tiny_llama(seed=3, init=0.05))


def regenerated(target: TargetModel, n: int, seed: int, new_tokens: int = 48) -> list[dict]:
    """What `blockdraft data` produces, in miniature: random prompts answered greedily by the target itself
    (one batched HF generate; equal prompt lengths, so no padding)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 90, (n, 8), generator=g)
    out = target.hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return [{"id": f"s{seed}-{i}", "input_ids": row.tolist(), "loss_mask": [0] * 8 + [1] * new_tokens}
            for i, row in enumerate(out)]


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(out_dir=str(tmp_path / "run"), num_layers=1, block_size=8, num_target_features=2,
                mask_token_id=MASK_ID, anchors=16, lr=3e-3, seqs_per_step=2, steps=12, save_every=5,
                log_every=1, precision="fp32", seed=0, init="random", draft_vocab_size=0, warmup=1, min_lr_ratio=0.0)
    base.update(kw)
    return TrainConfig(**base)


def test_loss_decreases(tiny, tmp_path):
    recs = regenerated(tiny, 8, seed=1)
    summary = train(_cfg(tmp_path, steps=40), target=tiny, records=recs, progress=False)
    first, last = sum(summary["losses"][:5]) / 5, sum(summary["losses"][-5:]) / 5
    assert last < first - 0.15, (first, last)  # deterministic run: 4.58 -> 4.36 when written
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 40 and len(log[-1]["acc"]) == 7


def test_resume_replays_the_uninterrupted_run(tiny, tmp_path):
    recs = regenerated(tiny, 6, seed=2)
    full = train(_cfg(tmp_path / "a"), target=tiny, records=recs, progress=False)
    part = train(_cfg(tmp_path / "b"), target=tiny, records=recs, progress=False, stop_after=7)
    assert part["steps"] == 7
    with pytest.raises(FileExistsError):
        train(_cfg(tmp_path / "b"), target=tiny, records=recs, progress=False)
    rest = train(_cfg(tmp_path / "b"), target=tiny, records=recs, progress=False, resume=True)
    assert rest["steps"] == 12
    assert part["losses"] + rest["losses"] == pytest.approx(full["losses"], rel=1e-6, abs=1e-7)


def test_trained_draft_accepts_more_on_heldout_text(tiny, tmp_path):
    recs, held = regenerated(tiny, 48, seed=4), regenerated(tiny, 6, seed=5)
    prompts = [prompt_of(r) for r in held]
    cfg = _cfg(tmp_path, steps=150, seqs_per_step=2, num_layers=2, lr=3e-3, save_every=1000, log_every=50)
    summary = train(cfg, target=tiny, records=recs, progress=False)
    from blockdraft.models.draft import DFlashDraftModel

    trained = DFlashDraftModel.from_pretrained(summary["out"], dtype=torch.float32)
    untrained = make_draft(cfg, tiny)
    tau_trained = evaluate_tau(tiny, trained, prompts, 40)
    tau_untrained = evaluate_tau(tiny, untrained, prompts, 40)
    assert tau_trained > tau_untrained + 0.2, (tau_untrained, tau_trained)


def test_online_and_offline_features_give_the_same_batches(tiny, tmp_path):
    recs = regenerated(tiny, 3, seed=6, new_tokens=20)
    layers = [1, 2]  # what make_draft picks for 2 features of a 5-layer target
    precompute_features(tiny, layers, recs, tmp_path / "feats", shard_size=2, dtype=torch.float32)
    online, offline = OnlineFeatures(tiny, layers), OfflineFeatures(tmp_path / "feats", layers)
    cfg = _cfg(tmp_path, num_target_features=2)

    draft = make_draft(cfg, tiny)
    assert draft.config.target_layer_ids == layers
    for i, r in enumerate(recs):
        torch.testing.assert_close(online(r), offline(r))
        a = sample_loss(TrainModule(draft), tiny, r, online, cfg, draft.config, i)
        b = sample_loss(TrainModule(draft), tiny, r, offline, cfg, draft.config, i)
        torch.testing.assert_close(a.loss, b.loss)
    with pytest.raises(ValueError, match="layers"):
        OfflineFeatures(tmp_path / "feats", [0, 3])


def test_corrupt_training_data_names_file_and_line(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    good = json.dumps({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})
    (d / "shard-00000.jsonl").write_text(good + "\n" + '{"id": "b", "input_ids": [1, 2' + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"shard-00000\.jsonl:2"):
        load_records(d)
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "missing")


def test_yaml_config_rejects_unknown_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("num_layers: 2\nlearning_rate: 1\n")
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.from_yaml(str(p))
    p.write_text("num_layers: 2\nblock_size: 8\n")
    assert TrainConfig.from_yaml(str(p), lr=1e-3).lr == 1e-3
    assert TrainConfig(decode_method="tree").decode_method == "dflash-tree"  # an alias, stored by its name
    for bad in ("pld", "nope"):  # not a method, or one that decodes without the draft
        with pytest.raises(ValueError, match="decode_method"):
            TrainConfig(decode_method=bad)


def test_reduced_vocabulary_training(tiny, tmp_path):
    from blockdraft.models.draft import DFlashDraftModel

    recs = regenerated(tiny, 6, seed=8, new_tokens=24)
    top = frequent_tokens(recs, 10, 99, always=(97,))
    assert top.numel() == 10 and 97 in top.tolist() and torch.equal(top, top.sort().values)
    summary = train(_cfg(tmp_path, draft_vocab_size=10, steps=4, decode_method="dflash-tree"), target=tiny,
                    records=recs, progress=False)
    assert all(l == l for l in summary["losses"])  # finite, no NaN
    d = DFlashDraftModel.from_pretrained(summary["out"])
    assert d.config.draft_vocab_size == 10 and d.vocab_ids.tolist() == top.tolist()
    assert d.config.decode_method == "dflash-tree"  # the recipe's recommendation reaches the saved config


def test_layer_init_from_target_reproduces_its_values(tiny):
    """init_layers='target': draft layer i is a copy of target layer L-n+i, and the context values of draft layer 0
    are exactly what target layer L-n computes from the deepest tapped layer (when that layer feeds it)."""
    from blockdraft.models.draft import DFlashDraftModel
    from blockdraft.models.draft_config import DFlashConfig

    n, nl = 2, tiny.num_layers
    cfg = DFlashConfig.from_target(tiny.config, num_hidden_layers=n, block_size=8, mask_token_id=MASK_ID,
                                   target_layer_ids=[nl - n - 1, 0])  # deepest first: the fc must pick it out
    with seeded(0):  # the layers are copied from the target; the rest (e.g. the final norm) starts random
        draft = DFlashDraftModel(cfg).float().init_layers_from_target(tiny)
    for mine, theirs in zip(draft.layers, tiny.layers[nl - n:]):
        torch.testing.assert_close(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight.float())
        torch.testing.assert_close(mine.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight.float())
    tiny.set_layer_ids(cfg.target_layer_ids)
    ids = torch.randint(0, 90, (1, 11), generator=torch.Generator().manual_seed(0))
    feats = tiny(ids, None, tap=True).features  # [1, 11, 2H], in target_layer_ids order
    _, vs = draft.context_kv(feats, torch.arange(11).unsqueeze(0))
    src = tiny.layers[nl - n]
    h = feats[..., : tiny.hidden_size]
    ref = src.self_attn.v_proj(src.input_layernorm(h)).view(1, 11, -1, cfg.head_dim).transpose(1, 2)
    torch.testing.assert_close(vs[0], ref, rtol=1e-5, atol=1e-5)  # fp32: stacked projection vs the layer's modules
    with pytest.raises(ValueError, match="layers"):
        DFlashDraftModel(DFlashConfig.from_target(tiny.config, num_hidden_layers=nl + 1, block_size=8,
                                                  mask_token_id=MASK_ID, num_target_features=2)
                         ).init_layers_from_target(tiny)


def test_a_narrower_draft_mlp_keeps_the_targets_strongest_channels(tiny):
    """intermediate_size below the target's: the copied MLP equals the target's MLP with every other channel's
    activation zeroed (the naive reference), on the channels of the largest |gate| * |up| * |down| norms."""
    from blockdraft.models.draft import DFlashDraftModel
    from blockdraft.models.draft_config import DFlashConfig

    src = tiny.layers[-1].mlp
    full = src.down_proj.weight.shape[1]
    width = full // 2 + 1  # odd sizes: nothing lines up by accident
    cfg = DFlashConfig.from_target(tiny.config, num_hidden_layers=1, block_size=8, mask_token_id=MASK_ID,
                                   num_target_features=2, intermediate_size=width)
    draft = DFlashDraftModel(cfg).float().init_layers_from_target(tiny)
    score = (src.gate_proj.weight.float().norm(dim=1) * src.up_proj.weight.float().norm(dim=1)
             * src.down_proj.weight.float().norm(dim=0))
    kept = torch.zeros(full, dtype=torch.bool)
    kept[score.topk(width).indices] = True
    x = torch.randn(5, tiny.hidden_size, generator=torch.Generator().manual_seed(0))
    act = torch.nn.functional.silu(x @ src.gate_proj.weight.float().T) * (x @ src.up_proj.weight.float().T)
    ref = (act * kept) @ src.down_proj.weight.float().T
    torch.testing.assert_close(draft.layers[0].mlp(x), ref, rtol=1e-5, atol=1e-5)  # fp32, summed in another order
    with pytest.raises(ValueError, match="channels"):
        DFlashDraftModel(DFlashConfig.from_target(tiny.config, num_hidden_layers=1, block_size=8,
                                                  mask_token_id=MASK_ID, num_target_features=2,
                                                  intermediate_size=full + 1)).init_layers_from_target(tiny)


def test_target_labels_are_the_targets_greedy_tokens(tiny, tmp_path):
    """Teacher-forced target labels equal the data's labels on the target's own greedy text (same loss, fp32), and
    differ on text the target would not write."""

    greedy = regenerated(tiny, 1, seed=9, new_tokens=30)[0]
    noise = dict(greedy, id="noise", input_ids=greedy["input_ids"][:8] + torch.randint(
        0, 90, (30,), generator=torch.Generator().manual_seed(1)).tolist())
    cfg = _cfg(tmp_path)
    draft = make_draft(cfg, tiny)
    feats = OnlineFeatures(tiny, draft.config.target_layer_ids)
    module = TrainModule(draft)

    def loss(rec, tl):
        c = _cfg(tmp_path, target_labels=tl)
        return float(sample_loss(module, tiny, rec, feats, c, draft.config, 0).loss.detach())

    assert loss(greedy, True) == pytest.approx(loss(greedy, False), rel=1e-6)
    assert loss(noise, True) != pytest.approx(loss(noise, False), rel=1e-3)
    with pytest.raises(ValueError, match="online features"):
        sample_loss(module, tiny, greedy, lambda r: feats(r), _cfg(tmp_path, target_labels=True), draft.config, 0)


def _with_prompt_len(rec: dict, n_prompt: int) -> dict:
    return dict(rec, loss_mask=[0] * n_prompt + [1] * (len(rec["input_ids"]) - n_prompt))


@pytest.mark.parametrize("train_block", [8, 4])
def test_batched_loss_is_the_row_weighted_mean_of_the_solo_losses(tiny, tmp_path, train_block):
    """One batched forward over sequences of different lengths and anchor counts gives each sequence the hidden
    states its solo forward gives (right padding and empty anchor slots change nothing), so its loss is the
    decay-weighted mean over all labelled rows: sum_i loss_i * W_i / sum_i W_i with W_i sequence i's weight sum.
    Blocks of the draft's size (8) or shorter (train_block 4; the decay stays the draft's). fp32; the tolerance
    covers summation order only."""
    from blockdraft.train.blocks import build_blocks, default_gamma, loss_weights, sample_anchors
    from blockdraft.train.live import batch_loss

    recs = [regenerated(tiny, 1, seed=20 + i, new_tokens=n)[0] for i, n in enumerate((30, 17, 41))]
    recs[1] = _with_prompt_len(recs[1], 12)  # a longer prompt: fewer valid anchors than the others
    cfg = _cfg(tmp_path, anchors=9, batched=True, train_block=train_block)
    draft = make_draft(cfg, tiny)
    feats = OnlineFeatures(tiny, draft.config.target_layer_ids)
    module = TrainModule(draft)
    indices = [5, 11, 2]
    solo = [sample_loss(module, tiny, r, feats, cfg, draft.config, i) for r, i in zip(recs, indices)]
    weights = []
    for r, i in zip(recs, indices):
        lm = torch.tensor(r["loss_mask"])
        a = sample_anchors(lm, cfg.anchors, train_block, torch.Generator().manual_seed(cfg.seed * 1_000_003 + i))
        bb = build_blocks(torch.tensor(r["input_ids"]), lm, a, train_block, MASK_ID)
        w = loss_weights(bb.offsets, default_gamma(8))
        weights.append(float(w[bb.labels != -100].sum()))
    both = batch_loss(module, tiny, recs, feats, cfg, draft.config, indices)
    want = sum(float(s.loss.detach()) * w for s, w in zip(solo, weights)) / sum(weights)
    assert float(both.loss.detach()) == pytest.approx(want, rel=1e-5)
    assert torch.equal(both.counted, sum(s.counted for s in solo))
    assert torch.equal(both.correct, sum(s.correct for s in solo))
    assert both.counted.numel() == train_block and int(both.counted[0]) == 0  # row 0 is the anchor: no label
    both.loss.backward()  # the batched graph reaches the draft's weights
    assert all(p.grad is not None for p in draft.layers[0].parameters())


def test_batched_training_steps_see_the_records_the_sequential_steps_see(tiny, tmp_path):
    """`batched` changes how a step's sequences are computed, not which: two steps of each give the same
    per-position row counts (same records, same anchors)."""
    recs = regenerated(tiny, 6, seed=30, new_tokens=24)
    runs = {}
    for batched in (False, True):
        cfg = _cfg(tmp_path / str(batched), batched=batched, steps=2, seqs_per_step=3)
        draft = make_draft(cfg, tiny)
        obj = __import__("blockdraft.train.live", fromlist=["LiveObjective"]).LiveObjective(
            cfg, tiny, draft, recs, None, torch.float32)
        state = {"samples_seen": 0}
        runs[batched] = [obj.step(state, 0, 1)[2] for _ in range(2)]
    for a, b in zip(runs[False], runs[True]):
        assert torch.equal(a, b)


def test_hf_regeneration_answers_equal_unpadded_greedy_generation(tiny):
    """Left-padded batches of prompts of different lengths give each prompt the answer it gets alone; an answer
    stops after its end-of-turn token. fp32 tiny model; no tie within rounding on these seeds."""
    from blockdraft.train.regen_hf import cut_answer, generate_batched

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 9, 7, 12, 6)]
    eos = [int(tiny.hf.config.eos_token_id)]
    got: dict[int, list[int]] = {}
    stats = generate_batched(tiny.hf, prompts, eos_ids=eos, pad_id=0, max_new_tokens=10, batch_size=3,
                             on_batch=lambda idx, ans: got.update(zip(idx, ans)))
    assert sorted(got) == list(range(5)) and stats.answered == 5 and stats.batches == 2
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        solo = tiny.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                eos_token_id=eos, pad_token_id=0)[0, len(p):].tolist()
        assert got[i] == cut_answer(solo, eos)
    assert cut_answer([4, 7, 9, 7, 0], [9]) == [4, 7, 9]
    assert cut_answer([4, 7], [9]) == [4, 7]
    assert generate_batched(tiny.hf, prompts, eos_ids=eos, pad_id=0, max_new_tokens=4, batch_size=2,
                            deadline=0.0).answered == 0


def test_hf_regeneration_answers_a_batch_too_large_for_memory_in_halves(tiny, monkeypatch):
    """A batch that raises the device's out-of-memory error is split until it fits; every prompt still gets the
    answer the whole batch would have given it (each row is its own greedy decode)."""
    from blockdraft.train import regen_hf

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 9, 7, 12, 6)]
    eos = [int(tiny.hf.config.eos_token_id)]
    want: dict[int, list[int]] = {}
    regen_hf.generate_batched(tiny.hf, prompts, eos_ids=eos, pad_id=0, max_new_tokens=8, batch_size=5,
                              on_batch=lambda idx, ans: want.update(zip(idx, ans)))
    real = regen_hf._generate_rows

    def small_memory(model, batch, *args):
        if len(batch) > 2:
            raise torch.OutOfMemoryError("a batch of more than 2 rows does not fit")
        return real(model, batch, *args)

    monkeypatch.setattr(regen_hf, "_generate_rows", small_memory)
    got: dict[int, list[int]] = {}
    stats = regen_hf.generate_batched(tiny.hf, prompts, eos_ids=eos, pad_id=0, max_new_tokens=8, batch_size=5,
                                      on_batch=lambda idx, ans: got.update(zip(idx, ans)))
    assert got == want and stats.answered == 5 and stats.splits == 2 and stats.batches == 3


def test_live_training_continues_a_draft_with_its_copy_gate_frozen(tiny, tmp_path):
    """The live source has no lookup candidates to train a copy gate on: a continued draft keeps its gate bit for
    bit while its layers train, and the saved draft still has it."""
    from blockdraft.models.draft import DFlashDraftModel

    recs = regenerated(tiny, 4, seed=3, new_tokens=20)
    base = make_draft(_cfg(tmp_path / "base"), tiny).with_copy_gate()
    with torch.no_grad():
        base.copy_gate.table.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
    base.save_pretrained(tmp_path / "gated")
    train(_cfg(tmp_path, init=str(tmp_path / "gated"), steps=3, batched=True), target=tiny, records=recs,
          progress=False)
    after = DFlashDraftModel.from_pretrained(tmp_path / "run" / "draft", dtype=torch.float32)
    assert after.config.copy_gate
    torch.testing.assert_close(after.copy_gate.table, base.copy_gate.table.float(), rtol=0, atol=0)
    assert not torch.equal(after.layers[0].mlp.up_proj.weight, base.layers[0].mlp.up_proj.weight.float())
    with pytest.raises(ValueError, match="copy gate"):  # the cache source trains the gate: it must be asked for
        make_draft(_cfg(tmp_path / "c", init=str(tmp_path / "gated"), cache="some/cache"), tiny)


def test_batched_is_refused_where_it_does_not_apply(tmp_path):
    for kw in (dict(cache="some/cache"), dict(method="eagle"), dict(target_labels=True)):
        with pytest.raises(ValueError, match="batched trains a DFlash draft from records"):
            TrainConfig(batched=True, **kw)
