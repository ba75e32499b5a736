"""The EAGLE-3 baseline: checkpoint layout and errors, greedy losslessness through the engine (useless, perfect and
half-right drafters), the sampling path, the KV cache against a one-shot forward, the vectorised training-time-test
forward against a naive per-query-mask reference and against the inference chain, training, resume and wiring."""

import json

import pytest
import torch

from blockdraft.config import GenerationConfig, SamplingParams
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.eagle import EagleConfig, EagleDraftModel, eagle_target_layer_ids, is_eagle_draft
from blockdraft.decode.engine import Engine
from blockdraft.decode.proposers.eagle import EagleProposer
from blockdraft.models.target import TargetModel
from blockdraft.train.blocks import IGNORE
from blockdraft.train.eagle import ttt_forward, ttt_labels
from blockdraft.train.config import TrainConfig
from blockdraft.train.trainer import train
from conftest import ToyTokenizer, naive_greedy, seeded, tiny_draft, tiny_llama, tiny_qwen3

N_NEW = 30
BIG = 100.0  # one-hot logit for a forced draft token


def tiny_eagle(target: TargetModel, seed: int = 1, std: float = 0.3) -> EagleDraftModel:
    """Random EAGLE drafter; std 0.3 (not 0.02) so its proposals vary instead of being one near-uniform argmax."""
    with seeded(seed), torch.no_grad():
        d = EagleDraftModel(EagleConfig.from_target(target.config))
        d.reset_parameters(std)
        for p in d.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))  # norms away from 1, so a skipped norm shows up
    return d.eval()


def _prompt(seed: int = 0, n: int = 9) -> torch.Tensor:
    return torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(seed))


def _features(target: TargetModel, draft: EagleDraftModel, ids: torch.Tensor):
    """ids [L] -> (features [1, L, 3H], embeds [1, L, H]) of the whole sequence."""
    target.set_layer_ids(draft.config.target_layer_ids)
    out = target(ids.unsqueeze(0), None, tap=True)
    return out.features, target.embed(ids.unsqueeze(0))


# ------------------------------------------------------------------------------------------- config, save/load
def test_layer_ids_follow_eagle3_and_fall_back_on_shallow_targets():
    assert eagle_target_layer_ids(30) == [1, 14, 26]  # SmolLM2-135M: layers 1, L//2-1, L-4
    assert eagle_target_layer_ids(5) == [0, 2, 4]  # 1, 1, 1 would repeat: spread evenly instead
    ids = eagle_target_layer_ids(4)
    assert len(set(ids)) == 3 and max(ids) < 4


def test_save_load_roundtrip_and_errors(llama_target, tmp_path):
    d = tiny_eagle(llama_target)
    d.save_pretrained(tmp_path / "e")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == d.config.target_layer_ids
    loaded = EagleDraftModel.from_pretrained(tmp_path / "e")
    assert loaded.dtype == torch.bfloat16 and loaded.config == d.config
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "e" / "model.safetensors")))
    assert "midlayer.self_attn.q_proj.weight" in keys and not any("embed" in k or "lm_head" in k for k in keys)
    assert loaded.midlayer.self_attn.q_proj.weight.shape == (4 * 12, 2 * 48)  # q reads [embedding; hidden]
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)), k
    d.save_pretrained(tmp_path / "e32", dtype=torch.float32)
    exact = EagleDraftModel.from_pretrained(tmp_path / "e32")
    assert all(torch.equal(exact.state_dict()[k], v) for k, v in d.state_dict().items())

    assert is_eagle_draft(tmp_path / "e") and not is_eagle_draft(tmp_path / "nowhere")
    tiny_draft(llama_target).save_pretrained(tmp_path / "dflash")
    assert not is_eagle_draft(tmp_path / "dflash")
    with pytest.raises(ValueError, match="not an EAGLE draft"):
        EagleDraftModel.from_pretrained(tmp_path / "dflash")
    with pytest.raises(FileNotFoundError, match="not a draft directory"):
        EagleDraftModel.from_pretrained(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        EagleDraftModel.from_pretrained(bad)
    (bad / "config.json").write_text((tmp_path / "e" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        EagleDraftModel.from_pretrained(bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 50)
    with pytest.raises(ValueError, match="safetensors"):
        EagleDraftModel.from_pretrained(bad)
    wrong = json.loads((tmp_path / "e" / "config.json").read_text())
    wrong["intermediate_size"] = 41
    (bad / "config.json").write_text(json.dumps(wrong))
    (bad / "model.safetensors").write_bytes((tmp_path / "e" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="does not match its config"):
        EagleDraftModel.from_pretrained(bad)


def test_check_compatible(llama_target):
    qwen = TargetModel(tiny_qwen3())
    d = tiny_eagle(llama_target)
    d.check_compatible(llama_target)
    with pytest.raises(ValueError, match="hidden size 48 != target's 40"):
        d.check_compatible(qwen)
    far = EagleDraftModel(EagleConfig.from_target(llama_target.config, target_layer_ids=[0, 2, 7]))
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 2, 7\] out of range"):
        EagleProposer(far, llama_target)
    with pytest.raises(ValueError, match="3 target layers"):
        EagleConfig.from_target(llama_target.config, target_layer_ids=[0, 2])


# --------------------------------------------------------------------------------------- inference, lossless
class ScriptedEagle(EagleProposer):
    """The real drafter runs (cache, rows, crops), but its logits are replaced by one-hot logits of the true
    continuation, wrong wherever `wrong(position)` says so: a perfect or a half-right drafter."""

    def __init__(self, draft, target, gamma, prompt_len, continuation, wrong=lambda pos: False):
        super().__init__(draft, target, gamma)
        self.prompt_len, self.cont, self.wrong = prompt_len, continuation, wrong

    def _logits(self, out, position):
        real = super()._logits(out, position)
        tok = self.cont[position - self.prompt_len]
        if self.wrong(position):
            tok = (tok + 1) % real.shape[-1]
        return torch.full_like(real, -BIG).index_fill_(0, torch.tensor(tok), BIG)


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_random_drafter_is_token_exact(target: TargetModel, gamma: int, one_thread):
    prompt = _prompt()
    ref = naive_greedy(target, prompt, N_NEW)
    eng = Engine(target, EagleProposer(tiny_eagle(target), target, gamma=gamma))
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True))
    assert res.token_ids == ref
    assert len(res.stats.accept_lengths) >= 5, "several verify rounds"
    assert sum(res.stats.accept_lengths) + 1 == N_NEW and max(res.stats.accept_lengths) <= gamma + 1
    assert len(res.stats.position_trials) == gamma


@pytest.mark.parametrize("gamma,half", [(1, False), (4, False), (4, True)])
def test_greedy_scripted_drafter_is_token_exact(llama_target, gamma: int, half: bool, one_thread):
    prompt = _prompt(1)
    ref = naive_greedy(llama_target, prompt, N_NEW)
    # the token at prompt_len + i is ref[i - 1] (ref[0] is the prefill's token); positions % 3 == 0 go wrong
    wrong = (lambda pos: pos % 3 == 0) if half else (lambda pos: False)
    prop = ScriptedEagle(tiny_eagle(llama_target), llama_target, gamma, prompt.numel() + 1, ref[1:] + [0] * 8,
                         wrong)
    res = Engine(llama_target, prop).generate(prompt, GenerationConfig(max_new_tokens=N_NEW,
                                                                                  ignore_eos=True))
    assert res.token_ids == ref
    if half:
        assert 1 < len(set(res.stats.accept_lengths)), res.stats.accept_lengths  # partial acceptances
    else:
        assert all(a == gamma + 1 for a in res.stats.accept_lengths[:-1])
        assert res.stats.position_accepted == res.stats.position_trials


def test_sampling_returns_the_draft_distribution_and_the_engine_runs(llama_target, one_thread):
    draft = tiny_eagle(llama_target)
    prop = EagleProposer(draft, llama_target, gamma=3)
    prompt = _prompt(2)
    feats, _ = _features(llama_target, draft, prompt)
    prop.start(prompt, feats[:, :-1])
    sp = SamplingParams(temperature=1.0, top_k=20, seed=0)
    out = prop.propose(prompt, 3, sp, torch.Generator().manual_seed(0))
    assert out.candidates.shape == (3,) and out.q.shape == (3, 99)
    torch.testing.assert_close(out.q.sum(-1), torch.ones(3))
    assert bool((out.q.gather(1, out.candidates.unsqueeze(1)) > 0).all())
    assert int((out.q[0] > 0).sum()) == 20  # top-k applied to q as to p
    assert prop.cache.length == prompt.numel() - 1, "speculative rows cropped"

    eng = Engine(llama_target, EagleProposer(draft, llama_target, gamma=4))
    cfg = GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True)
    a = eng.generate(prompt, cfg, SamplingParams(temperature=1.0, seed=7))
    b = eng.generate(prompt, cfg, SamplingParams(temperature=1.0, seed=7))
    assert len(a.token_ids) == N_NEW and a.token_ids == b.token_ids


class RecordingEagle(EagleProposer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = []

    def propose(self, tokens, num_draft, sampling, generator):
        out = super().propose(tokens, num_draft, sampling, generator)
        self.log.append((tokens.clone(), out.candidates.clone()))
        return out


def test_proposals_equal_an_uncached_chain_from_scratch(target: TargetModel, one_thread):
    """Every proposal of a multi-round generation (rows queued by start/accept, cached, speculative rows cropped)
    equals the chain recomputed from nothing: all rows 0..n-2 from fresh target features, then gamma-1 steps each
    reading the previous hidden state and its argmax token at the next position."""
    draft = tiny_eagle(target, seed=2)
    prop = RecordingEagle(draft, target, gamma=3)
    Engine(target, prop).generate(_prompt(6), GenerationConfig(max_new_tokens=N_NEW, ignore_eos=True))
    assert len(prop.log) >= 5
    for tokens, drafted in prop.log:
        n = tokens.numel()
        feats, embeds = _features(target, draft, tokens)
        h, k, v = draft.step(embeds[:, 1:], draft.fuse(feats[:, :-1]), torch.arange(1, n)[None])
        h, ref = h[:, -1:], []
        for j in range(drafted.numel()):
            tok = target.logits(draft.norm(h))[0, 0].argmax()
            ref.append(int(tok))
            h, k1, v1 = draft.step(target.embed(tok.view(1, 1)), h, torch.tensor([[n + j]]), k, v)
            k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
        assert drafted.tolist() == ref, n


def test_cached_rows_equal_a_one_shot_forward(llama_target):
    """The proposer feeds rows in chunks over a KV cache; that must equal one causal forward over all rows."""
    draft = tiny_eagle(llama_target)
    ids = _prompt(3, 15)
    feats, embeds = _features(llama_target, draft, ids)
    g, e = draft.fuse(feats[:, :-1]), embeds[:, 1:]
    pos = torch.arange(1, 15).unsqueeze(0)
    full, _, _ = draft.step(e, g, pos)
    a, k, v = draft.step(e[:, :6], g[:, :6], pos[:, :6])
    b, _, _ = draft.step(e[:, 6:], g[:, 6:], pos[:, 6:], k, v)
    torch.testing.assert_close(torch.cat([a, b], 1), full)


# ---------------------------------------------------------------------------------------- training-time test
def naive_ttt(draft: EagleDraftModel, feats: torch.Tensor, embeds: torch.Tensor, steps: int) -> torch.Tensor:
    """Reference: step j attends over [step-0 keys; step-1 keys; ...; step-j keys] (all rows each) with a mask built
    query by query: row r sees step-0 rows <= r and row r of steps 1..j. Plain SDPA, no diagonal trick."""
    seq_len = embeds.shape[1]
    t = seq_len - 1
    hidden = draft.fuse(feats[:, :-1])
    keys, vals, outs = [], [], []
    for j in range(steps + 1):
        pos = torch.arange(t) + 1 + j
        q, k, v = draft.project(embeds[:, pos.clamp(max=seq_len - 1)], hidden, pos.unsqueeze(0))
        keys.append(k)
        vals.append(v)
        mask = torch.zeros(t, (j + 1) * t, dtype=torch.bool)
        for r in range(t):
            for c in range(r + 1):
                mask[r, c] = True
            for s in range(1, j + 1):
                mask[r, s * t + r] = True
        att = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(vals, 2),
                                                               attn_mask=mask, enable_gqa=True)
        hidden = draft.finish(hidden, att)
        outs.append(hidden[0])
    return torch.stack(outs)


def test_ttt_forward_matches_the_naive_mask_and_the_inference_chain(llama_target):
    draft = tiny_eagle(llama_target)
    ids = _prompt(4, 17)
    steps = 3
    feats, embeds = _features(llama_target, draft, ids)
    fast = ttt_forward(draft, feats, embeds, steps)
    assert fast.shape == (steps + 1, 16, 48)
    torch.testing.assert_close(fast, naive_ttt(draft, feats, embeds, steps))
    # step j of row r is what inference computes as the j-th chained step after verified row r when the chain is
    # fed the true tokens (teacher forcing): same inputs, same positions, same visible keys
    for r in (0, 5, 12):
        h, k, v = draft.step(embeds[:, 1:r + 2], draft.fuse(feats[:, :r + 1]), torch.arange(1, r + 2)[None])
        h = h[:, -1:]
        torch.testing.assert_close(h[0, 0], fast[0, r], rtol=1e-4, atol=2e-4)  # SDPA vs the diagonal kernel
        for j in range(1, steps + 1):
            h, k1, v1 = draft.step(embeds[:, r + 1 + j:r + 2 + j], h, torch.tensor([[r + 1 + j]]), k, v)
            k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
            torch.testing.assert_close(h[0, 0], fast[j, r], rtol=1e-4, atol=2e-4)


def test_ttt_labels():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    lm = torch.tensor([0, 0, 0, 1, 1, 1])
    lab = ttt_labels(ids, lm, 2)
    X = IGNORE
    assert lab.tolist() == [[X, 13, 14, 15, X], [13, 14, 15, X, X], [14, 15, X, X, X]]


def _records(n: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"r{seed}-{i}", "input_ids": torch.randint(0, 90, (length,), generator=g).tolist(),
             "loss_mask": [0] * 5 + [1] * (length - 5)} for i in range(n)]


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(out_dir=str(tmp_path / "run"), method="eagle", ttt_steps=2, lr=5e-3, seqs_per_step=2, steps=25,
                save_every=5, log_every=1, precision="fp32", seed=0, warmup=1, min_lr_ratio=0.0)
    base.update(kw)
    return TrainConfig(**base)


def test_eagle_training_overfits_and_logs_per_step_accuracy(llama_target, tmp_path, one_thread):
    recs = _records(2, 23, seed=1)
    summary = train(_cfg(tmp_path), target=llama_target, records=recs, progress=False)
    first, last = summary["losses"][0], sum(summary["losses"][-3:]) / 3
    assert last < first - 1.0, (first, last)
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 25 and len(log[-1]["acc"]) == 3  # steps 0, 1, 2
    assert log[-1]["acc"][0] > 0.5
    d = EagleDraftModel.from_pretrained(summary["out"], dtype=torch.float32)
    assert d.config.extra["trained_with"] == "blockdraft"
    # the trained drafter serves through build_engine, losslessly
    from blockdraft.decode.spec import DecodeSpec, build_engine
    from blockdraft.models.loading import load_draft

    eng = build_engine(llama_target, load_draft(tmp_path / "run" / "draft", llama_target), DecodeSpec(block_size=4))
    assert isinstance(eng.proposer, EagleProposer) and eng.proposer.gamma == 3
    prompt = _prompt(5)
    assert eng.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids == naive_greedy(
        llama_target, prompt, 12)


def test_eagle_resume_replays_the_uninterrupted_run(llama_target, tmp_path, one_thread):
    recs = _records(3, 19, seed=2)
    kw = dict(steps=8, save_every=3)
    full = train(_cfg(tmp_path / "a", **kw), target=llama_target, records=recs, progress=False)
    part = train(_cfg(tmp_path / "b", **kw), target=llama_target, records=recs, progress=False, stop_after=4)
    rest = train(_cfg(tmp_path / "b", **kw), target=llama_target, records=recs, progress=False, resume=True)
    assert part["steps"] == 4 and rest["steps"] == 8
    assert part["losses"] + rest["losses"] == pytest.approx(full["losses"], rel=1e-6, abs=1e-7)
    with pytest.raises(ValueError, match="method"):
        train(_cfg(tmp_path / "c", method="medusa"), target=llama_target, records=recs, progress=False)


# ---------------------------------------------------------------------------------------------------- wiring
def test_cli_and_bench_wiring(tmp_path, one_thread):
    from blockdraft.cli import build_parser
    from blockdraft.cli.bench import config_from_args
    from blockdraft.eval.bench import BenchConfig, run_bench
    from blockdraft.prompts.base import Prompt

    args = build_parser().parse_args(["train", "--data", "x", "--method", "eagle", "--ttt-steps", "5"])
    assert args.method == "eagle" and args.ttt_steps == 5
    args = build_parser().parse_args(["bench", "--eagle-draft", "e", "--gamma", "3"])
    cfg = config_from_args(args)
    assert cfg.eagle_draft == "e" and cfg.gamma == 3 and "eagle" in cfg.methods

    target = TargetModel(tiny_llama(), ToyTokenizer())
    tiny_eagle(target).save_pretrained(tmp_path / "eagle", dtype=torch.float32)
    dflash = tiny_draft(target, block_size=6)
    prompts = [Prompt(id="p", task="chat", messages=[{"role": "user", "content": "x"}])]
    tok = _EncodingTokenizer()
    res = run_bench(BenchConfig(methods=("ar", "dflash", "eagle"), max_new_tokens=10, dtype="fp32", plots=False,
                                progress=False, out=str(tmp_path / "b"), eagle_draft=str(tmp_path / "eagle"),
                                gamma=3, threads=1), target=target, tokenizer=tok, draft=dflash, prompts=prompts)
    assert res["methods"] == ["ar", "dflash", "eagle"] and res["block_sizes"]["eagle"] == 4
    recs = {r["method"]: r for r in res["records"]}
    assert recs["eagle"]["match_ar"] and recs["dflash"]["match_ar"]  # fp32 greedy: both lossless
    assert len(recs["eagle"]["position_trials"]) == 3
    res = run_bench(BenchConfig(methods=("ar", "eagle"), max_new_tokens=4, dtype="fp32", plots=False,
                                progress=False, out=str(tmp_path / "c"), warmup=False),
                    target=target, tokenizer=tok, prompts=prompts)
    assert res["methods"] == ["ar"] and any("eagle skipped" in n for n in res["notes"])


class _EncodingTokenizer(ToyTokenizer):
    chat_template = "stub"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [0, 5, 17, 33, 41, 5, 17, 2]


def test_dflash_draft_dir_still_builds_a_dflash_engine(llama_target, tmp_path):
    from blockdraft.decode.proposers.dflash import DFlashProposer
    from blockdraft.decode.spec import DecodeSpec, build_engine
    from blockdraft.models.loading import load_draft

    tiny_draft(llama_target).save_pretrained(tmp_path / "d")
    draft = load_draft(tmp_path / "d", llama_target)
    assert isinstance(build_engine(llama_target, draft, DecodeSpec()).proposer, DFlashProposer)
    assert isinstance(DFlashDraftModel.from_pretrained(tmp_path / "d"), DFlashDraftModel)
