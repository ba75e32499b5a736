import json

import numpy as np
import pytest

from blockdraft.prompts import load_task
from blockdraft.prompts.base import Prompt
from blockdraft.train import data as D
from blockdraft.train import records as R


def P(pid, text, task="t"):
    return Prompt(id=pid, task=task, messages=[{"role": "user", "content": text}])


# ---------------------------------------------------------------- ShareGPT


def test_tolerant_array_parse():
    items, complete = D.parse_json_array_tolerant('[ {"a": 1},\n {"b": [1, "x]"]}, {"c": "trunc')
    assert items == [{"a": 1}, {"b": [1, "x]"]}] and not complete
    assert D.parse_json_array_tolerant('[{"a": 1}, {"b": 2}]') == ([{"a": 1}, {"b": 2}], True)
    assert D.parse_json_array_tolerant(" [ ] ") == ([], True)
    assert D.parse_json_array_tolerant('[{"a": 1}, {"b"') == ([{"a": 1}], False)
    with pytest.raises(ValueError):
        D.parse_json_array_tolerant('{"a": 1}')


def test_sharegpt_handmade_truncated(tmp_path):
    convs = [
        {"id": "c1", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                                       {"from": "human", "value": "Q2"}]},
        {"id": "c2", "conversations": [{"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "Q3"}]},
        {"id": "c3", "conversations": []},
        {"id": "c4", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q4"}]},
    ]
    text = json.dumps(convs, indent=2)
    cut = text[: text.index('"c4"') + 30]  # truncated inside the last element
    path = tmp_path / "sg.json"
    path.write_text(cut)
    got = D.sharegpt_conversations(path)
    assert [cid for cid, _ in got] == ["c1", "c2", "c3"]
    assert got[0][1] == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                         {"role": "user", "content": "Q2"}]
    ps = D.sharegpt_prompts(path)
    assert [(p.id, p.messages) for p in ps] == [("sharegpt/c1", [{"role": "user", "content": "Q1"}]),
                                                ("sharegpt/c2", [{"role": "user", "content": "Q3"}])]
    path.write_text(text)
    assert [p.messages for p in D.sharegpt_prompts(path)][-1] == [{"role": "system", "content": "S"},
                                                                  {"role": "user", "content": "Q4"}]


def test_sharegpt_real_file():
    ps = D.sharegpt_prompts()
    assert len(D.sharegpt_conversations()) > 17000
    assert len(ps) > 17000
    assert len({p.id for p in ps}) == len(ps)
    assert all(p.messages[-1]["role"] == "user" for p in ps)


# ---------------------------------------------------------------- other sources


def test_gsm_prompts_deterministic_and_clean():
    a = D.gsm_prompts(120, seed=1)
    assert len(a) == 120 and a == D.gsm_prompts(120, seed=1)
    assert a != D.gsm_prompts(120, seed=2)
    assert len({p.task for p in a}) == 1 and len({p.id for p in a}) == 120
    assert sum("gsm_symbolic" in p.id for p in a) >= 60  # mostly GSM-style, with other generators for variety
    deco = D.eval_decontaminator()
    assert sum(p.user_text in deco for p in a) == 0  # eval templates are not used for training


def test_jsonl_corrupt_line(tmp_path):
    path = tmp_path / "user.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "b"}]})
                    + "\n\n" + '{"prompt": "trunc')
    with pytest.raises(ValueError, match=r"user\.jsonl:4"):
        D.jsonl_prompts(path)
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"nothing": 1}) + "\n")
    with pytest.raises(ValueError, match=r"user\.jsonl:2"):
        D.jsonl_prompts(path)


# ---------------------------------------------------------------- prompt set


def test_dedupe_and_split_determinism():
    base = [P(f"p{i}", f"Question number {i} about something") for i in range(400)]
    dupes = [P("d1", "  question NUMBER 3 about\nsomething "), P("d2", "Question number 7 about something")]
    tr, he, rep = D.build_prompt_set([base, dupes], seed=0, heldout_fraction=0.1, decontaminate=False)
    assert rep.duplicates == 2 and rep.total == 402
    assert len(tr) + len(he) == 400 and rep.train == len(tr) and rep.heldout == len(he)
    assert 15 <= len(he) <= 70
    tr2, he2, _ = D.build_prompt_set([base, dupes], seed=0, heldout_fraction=0.1, decontaminate=False)
    assert (tr, he) == (tr2, he2)
    _, he3, _ = D.build_prompt_set([base], seed=1, heldout_fraction=0.1, decontaminate=False)
    assert {p.id for p in he3} != {p.id for p in he}
    # membership depends only on the prompt itself
    _, he4, _ = D.build_prompt_set([base[:200]], seed=0, heldout_fraction=0.1, decontaminate=False)
    assert {p.id for p in he4} == {p.id for p in he if int(p.id[1:]) < 200}
    with pytest.raises(ValueError):
        D.build_prompt_set([[P("same", "a"), P("same", "b")]], decontaminate=False)


def test_decontamination_drops_eval_copies():
    he0 = next(p for p in load_task("code") if p.id == "code/humaneval-0")
    code = he0.messages[0]["content"].split("```python\n")[1].rstrip("`\n")
    mt = load_task("chat")[0]
    gsm = next(p for p in load_task("math") if p.id.startswith("math/gsm-"))
    clean = [P("ok1", "Write a haiku about autumn leaves."), P("ok2", "Explain how a bicycle gear works.")]
    copies = [
        P("c-code", "Can you implement this for me?\n" + code),
        P("c-mt", "Please help: " + mt.messages[0]["content"] + " Thanks!"),
        P("c-mt2", mt.extra_turns[0].upper()),  # exact match after normalisation (may be short)
        P("c-gsm", gsm.messages[0]["content"]),
    ]
    tr, he, rep = D.build_prompt_set([clean, copies], seed=0, heldout_fraction=0.0)
    assert {p.id for p in tr} == {"ok1", "ok2"} and he == []
    assert rep.contaminated == 4 and sorted(rep.contaminated_ids) == sorted(p.id for p in copies)
    tr, _, rep = D.build_prompt_set([clean, copies], seed=0, heldout_fraction=0.0, decontaminate=False)
    assert len(tr) == 6 and rep.contaminated == 0


# ---------------------------------------------------------------- shards and packing


def _rec(pid, n_prompt, n_resp, start=5):
    return {"id": pid, "input_ids": list(range(start, start + n_prompt + n_resp)),
            "loss_mask": [0] * n_prompt + [1] * n_resp}


def test_read_shards_corrupt_line(tmp_path):
    good = json.dumps(_rec("a", 3, 2))
    cases = {
        "not json": '{"id": "b", "input_ids": [1,',
        "missing": json.dumps({"id": "b", "input_ids": [1]}),
        "mismatch": json.dumps({"id": "b", "input_ids": [1, 2], "loss_mask": [0]}),
    }
    for name, bad in cases.items():
        d = tmp_path / name.replace(" ", "_")
        d.mkdir()
        (d / R.shard_name(0)).write_text(good + "\n")
        (d / R.shard_name(1)).write_text(good.replace('"a"', '"c"') + "\n" + bad + "\n")
        it = R.read_shards(d)
        assert next(it)["id"] == "a" and next(it)["id"] == "c"
        with pytest.raises(ValueError, match=r"shard-00001\.jsonl:2"):
            next(it)


def test_pack_roundtrip(tmp_path):
    recs = [_rec("x", 4, 3), _rec("y", 2, 0, start=65530), _rec("z", 1, 5, start=0)]
    assert R.pack_uint16(recs, tmp_path / "p.npz") == 3
    assert R.load_packed(tmp_path / "p.npz") == recs
    R.pack_uint16([], tmp_path / "e.npz")
    assert R.load_packed(tmp_path / "e.npz") == []
    with pytest.raises(ValueError, match="uint16"):
        R.pack_uint16([_rec("big", 1, 1, start=65535)], tmp_path / "b.npz")
    with pytest.raises(ValueError, match="uint16"):
        R.pack_uint16(recs, tmp_path / "b.npz", vocab_size=100_000)


# ---------------------------------------------------------------- regeneration


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("torch")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from blockdraft.models.loading import materialize, resolve_target

    try:
        tok = AutoTokenizer.from_pretrained(materialize(resolve_target(None)))
    except FileNotFoundError as e:
        pytest.skip(f"default target unavailable: {e}")
    from conftest import seeded

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with seeded(0):
        model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return model, tok


def test_a_small_selection_still_holds_out_one_prompt_per_source(tiny):
    _, tok = tiny
    train, held, _ = D.select_regeneration_prompts(tok, n_sharegpt=12, n_gsm=12)
    assert [p.task for p in train].count("sharegpt") == 12 and [p.task for p in train].count("gsm") == 12
    assert sorted(p.task for p in held) == ["gsm", "sharegpt"]  # 2% of 12 rounds to 0: one of each instead
    assert not {p.id for p in held} & {p.id for p in train}
    big, big_held, _ = D.select_regeneration_prompts(tok, n_sharegpt=400, n_gsm=0)
    assert len(big_held) == round(400 * 0.02 / 0.98) and all(p.task == "sharegpt" for p in big_held)
    assert not D.select_regeneration_prompts(tok, n_sharegpt=12, n_gsm=12, heldout=False)[1]


PROMPTS = [P(f"r{i}", "Tell me about " + " and ".join(["cats"] * (i * 3 + 1)), task="sharegpt") for i in range(6)]


def test_regenerate_resume_matches_uninterrupted(tiny, tmp_path):
    model, tok = tiny
    kw = dict(max_new_tokens=6, batch_size=2, shard_size=4, progress=False)
    full = tmp_path / "full"
    rep = D.regenerate(model, tok, PROMPTS, full, **kw)
    assert rep.generated == 6 and rep.skipped_long == 0 and rep.batches == 3
    ref = {r["id"]: r for r in R.read_shards(full)}
    assert sorted(ref) == sorted(p.id for p in PROMPTS)
    assert sorted(p.name for p in full.iterdir()) == [R.shard_name(0), R.shard_name(1)]
    for p in PROMPTS:
        r = ref[p.id]
        prompt_ids = D.chat_token_ids(tok, p.messages)
        assert r["input_ids"][: len(prompt_ids)] == prompt_ids
        assert r["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(r["input_ids"]) - len(prompt_ids))
        assert 1 <= sum(r["loss_mask"]) <= 6

    part = tmp_path / "part"
    rep = D.regenerate(model, tok, PROMPTS, part, max_batches=2, **kw)
    assert rep.stopped_early and rep.generated == 4
    # simulate a kill mid-write: the last complete record is lost and a partial line is left behind
    shard = part / R.shard_name(0)
    lines = shard.read_text().splitlines(keepends=True)
    shard.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    rep = D.regenerate(model, tok, PROMPTS, part, **kw)
    assert rep.already_done == 3 and rep.generated == 3 and rep.truncated_bytes > 0
    got = list(R.read_shards(part))
    assert len(got) == 6 and {r["id"]: r for r in got} == ref
    rep = D.regenerate(model, tok, PROMPTS, part, **kw)  # nothing left: no duplicates
    assert rep.generated == 0 and len(list(R.read_shards(part))) == 6


def test_regenerate_eos_and_skip_long(tiny, tmp_path):
    model, tok = tiny
    probe = D.regenerate(model, tok, PROMPTS[:2], tmp_path / "probe", max_new_tokens=3, batch_size=2, progress=False)
    assert probe.generated == 2
    first = {r["id"]: r for r in R.read_shards(tmp_path / "probe")}
    n0 = len(D.chat_token_ids(tok, PROMPTS[0].messages))
    stop = first["r0"]["input_ids"][n0 + 1]  # make r0's second generated token the end-of-sequence token
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = stop
    try:
        long_limit = len(D.chat_token_ids(tok, PROMPTS[4].messages))
        rep = D.regenerate(model, tok, PROMPTS, tmp_path / "eos", max_new_tokens=3, batch_size=4,
                           max_prompt_tokens=long_limit, progress=False)
    finally:
        model.generation_config.eos_token_id = old
    assert rep.skipped_long == 1 and rep.generated == 5
    recs = {r["id"]: r for r in R.read_shards(tmp_path / "eos")}
    assert "r5" not in recs
    r0 = recs["r0"]["input_ids"][n0:]
    assert r0[-1] == stop and stop not in r0[:-1] and len(r0) <= 2


def test_regenerate_lean_path_matches_hf_generate(tiny, tmp_path):
    """The lean batched path writes the same records as model.generate (fp32, greedy)."""
    model, tok = tiny
    kw = dict(max_new_tokens=5, batch_size=3, progress=False)
    D.regenerate(model, tok, PROMPTS, tmp_path / "lean", **kw)
    D.regenerate(model, tok, PROMPTS, tmp_path / "hf", lean=False, **kw)
    lean = {r["id"]: r for r in R.read_shards(tmp_path / "lean")}
    hf = {r["id"]: r for r in R.read_shards(tmp_path / "hf")}
    assert lean == hf and len(lean) == len(PROMPTS)


def test_pending_of_task_skips_other_tasks_and_written_records(tmp_path):
    """A task-only regeneration (`regen_default.py --only-task`) plans over the prompts of that task not yet in the
    shards, in the prompt set's order; without shards, all of the task's prompts."""
    from blockdraft.train.records import ShardWriter

    prompts = [P(f"m{i}", f"q{i}", task="gsm" if i % 3 else "sharegpt") for i in range(9)]
    assert [p.id for p in D.pending_of_task(prompts, "gsm", tmp_path / "none")] == ["m1", "m2", "m4", "m5", "m7",
                                                                                    "m8"]
    w = ShardWriter(tmp_path / "shards", 4)
    w.write([{"id": i, "input_ids": [1, 2], "loss_mask": [0, 1]} for i in ("m2", "m3", "m7")])
    w.close()
    assert [p.id for p in D.pending_of_task(prompts, "gsm", tmp_path / "shards")] == ["m1", "m4", "m5", "m8"]
    assert D.pending_of_task(prompts, "jsonl", tmp_path / "shards") == []


def test_tokenized_prompt_files_round_trip_and_skip_what_is_answered(tmp_path):
    """The GPU round's prompt file: chat-formatted ids per prompt, long prompts and already-answered ones left
    out, ids and tokens read back exactly."""
    from blockdraft.prompts.base import Prompt
    from blockdraft.train.wide_prompts import prompt_ids_of_records, read_tokenized, write_tokenized

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
            return [1] + [len(w) for m in messages for w in m["content"].split()] + [2]

    ps = [Prompt(id=f"p{i}", task="t" if i % 2 else "u", messages=[{"role": "user", "content": text}])
          for i, text in enumerate(["a bb ccc", "dddd", "e " * 40, "ff gg"])]
    answered = prompt_ids_of_records([{"input_ids": [1, 4, 2, 9, 9], "loss_mask": [0, 0, 0, 1, 1]}])
    counts = write_tokenized(Tok(), ps, tmp_path / "p.npz", max_prompt_tokens=10, skip=answered)
    ids, toks = read_tokenized(tmp_path / "p.npz")
    assert ids == ["p0", "p3"] and toks == [[1, 1, 2, 3, 2], [1, 2, 2, 2]]
    assert counts == {"u": 1, "t": 1}

    class WideTok:  # a vocabulary over 65,536 tokens (Qwen's chat markers are ids ~151,644)
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
            return [151644] + [70000 + len(w) for m in messages for w in m["content"].split()] + [151645]

    write_tokenized(WideTok(), ps[:2], tmp_path / "wide.npz")
    assert read_tokenized(tmp_path / "wide.npz") == (["p0", "p1"], [[151644, 70001, 70002, 70003, 151645],
                                                                   [151644, 70004, 151645]])


def test_regenerate_records_teacher_data_in_the_same_pass(tiny, tmp_path):
    """With a RecordSpec the answers' teacher data comes from the pass that writes them: the tapped features and
    top-k logits equal, bit for bit, one prefill of the whole record on the same weights (the quantized kernels give
    a T-token forward the bits of T one-token steps); the positions the pass never computes are zeros (-1 ids)."""
    import torch

    from blockdraft.models.quant import WeightPlan
    from blockdraft.models.target import TargetModel
    from blockdraft.train.teacher import TeacherCache

    model, tok = tiny
    layers, k, max_len = (0, 1), 4, 48  # max_len cuts the longer records: the cut is exercised
    rec = D.RecordSpec(tmp_path / "teacher", layers, topk=k, max_len=max_len)
    kw = dict(max_new_tokens=6, batch_size=3, shard_size=4, progress=False, weights=WeightPlan("int8"))
    rep = D.regenerate(model, tok, PROMPTS, tmp_path / "shards", record=rec, **kw)
    assert rep.generated == 6 and rep.recorded == 6
    records = {r["id"]: r for r in R.read_shards(tmp_path / "shards")}
    cache = TeacherCache(tmp_path / "teacher")
    assert sorted(s.id for s in cache.sequences) == sorted(records) and cache.layer_ids == list(layers)
    target = TargetModel(model, tok, weights=WeightPlan("int8"))
    assert target.lean is not None and target.lean.native is not None  # the kernels' exactness is what is checked
    for seq in cache.sequences:
        r = records[seq.id]
        n = min(len(r["input_ids"]), max_len)
        p = r["loss_mask"].index(1)  # the first answer position: logits are kept from position p - 1 on
        assert list(seq.tokens) == r["input_ids"][:n] and list(seq.loss_mask) == r["loss_mask"][:n]
        ids = torch.tensor([r["input_ids"][:n]])
        out = target.forward(ids, target.new_decode_cache(n + 8), tap=layers)
        feats = out.features[0].to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
        got = np.asarray(seq.feats)
        last = min(n, len(r["input_ids"]) - 1)  # the final token is never fed
        assert (got[:last] == feats[:last]).all() and not got[last:].any()
        top = out.logits[0].float().topk(k, dim=-1)
        assert (np.asarray(seq.topk_ids[p - 1:last]) == top.indices[p - 1:last].numpy()).all()
        assert (np.asarray(seq.topk_logits[p - 1:last]) == top.values[p - 1:last].numpy().astype(np.float16)).all()
        assert (np.asarray(seq.greedy[:p - 1]) == -1).all() and (np.asarray(seq.greedy[last:]) == -1).all()
        # greedy decoding: the target's choice after every answer position is the token that follows it
        assert list(seq.greedy[p - 1:last]) == r["input_ids"][p:last + 1]

    rep = D.regenerate(model, tok, PROMPTS, tmp_path / "shards", record=rec, **kw)  # resumed: nothing twice
    assert rep.generated == 0 and rep.recorded == 0 and len(TeacherCache(tmp_path / "teacher")) == 6
    with pytest.raises(ValueError, match="written with"):  # another teacher into the same cache is refused
        D.regenerate(model, tok, PROMPTS, tmp_path / "shards", record=D.RecordSpec(tmp_path / "teacher", (1,)), **kw)


def test_teacher_cache_on_the_decode_path_equals_the_recorded_teacher_data(tiny, tmp_path):
    """Answers kept without their teacher data regain it: `build_teacher_cache(decode_path=True)` prefills each
    record through the decode path on the same quantized weights and gives, bit for bit, the features and top-k the
    answers' own pass recorded (on the positions that pass computes); its manifest says so, and a float cache in
    the same directory is refused."""
    from blockdraft.models.quant import WeightPlan
    from blockdraft.models.target import TargetModel
    from blockdraft.train.teacher import TeacherCache, build_teacher_cache

    model, tok = tiny
    layers, k, max_len = (0, 1), 4, 48
    rec = D.RecordSpec(tmp_path / "recorded", layers, topk=k, max_len=max_len)
    D.regenerate(model, tok, PROMPTS, tmp_path / "shards", record=rec, max_new_tokens=6, batch_size=3,
                 shard_size=4, progress=False, weights=WeightPlan("int8"))
    records = list(R.read_shards(tmp_path / "shards"))
    target = TargetModel(model, tok, weights=WeightPlan("int8"))
    build_teacher_cache(target, records, tmp_path / "prefilled", layers, topk=k, max_len=max_len, decode_path=True)
    recorded = {s.id: s for s in TeacherCache(tmp_path / "recorded").sequences}
    prefilled = TeacherCache(tmp_path / "prefilled")
    assert prefilled.manifest["source"] == "decode" and len(prefilled) == len(records)
    for seq in prefilled.sequences:
        r, old = next(x for x in records if x["id"] == seq.id), recorded[seq.id]
        last = min(len(r["input_ids"]), max_len, len(r["input_ids"]) - 1)  # the recorded pass never feeds the end
        p = r["loss_mask"].index(1)
        assert (np.asarray(seq.feats)[:last] == np.asarray(old.feats)[:last]).all()
        assert (np.asarray(seq.topk_ids)[p - 1:last] == np.asarray(old.topk_ids)[p - 1:last]).all()
        assert (np.asarray(seq.topk_logits)[p - 1:last] == np.asarray(old.topk_logits)[p - 1:last]).all()
        assert (np.asarray(seq.greedy)[p - 1:last] == np.asarray(old.greedy)[p - 1:last]).all()
    with pytest.raises(ValueError, match="written with"):
        build_teacher_cache(target, records, tmp_path / "prefilled", layers, topk=k, max_len=max_len)
