"""`blockdraft heldout-tau`: held-out tau of several drafts (DFlash or EAGLE) for one target, greedy, through the real
engine, on prompts never trained on; the same prompts and settings for every draft, so checkpoints of different
depths or steps compare directly (the ship criterion of a new draft version).

Prompt sets (`--set`):
- `regen` (default): the prompts of a held-out regenerated split (`--heldout DIR`, the `shards-heldout` that
  `blockdraft data` wrote; default: the packaged target's, from `data/smollm2-regen/heldout.npz` in a checkout).
- `gsm-unseen`: GSM-style problems from the gsm_symbolic templates that training never uses (the half the math
  benchmark draws from), instantiated with another seed, any question equal to a benchmark item removed. Held-out
  regenerated math shares its templates with training, so it cannot show how a draft does on unseen problem
  wording; this set can, without touching the benchmark's items.
- `user-math`, `user-code`, `user-chat`: the prompts written the way users write them (`prompts/realistic.py`),
  never trained on and sharing no template with training: how a draft generalises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..decode.spec import DecodeSpec, build_engine
from ..models.loading import load_draft, load_target
from ..prompts import load_task
from ..prompts.math import gsm_symbolic_items, gsm_template_split, load_all
from .data import chat_token_ids
from .live import prompt_of
from .records import load_records

PACKAGED_HELDOUT = (Path("data/work/regen-smollm2/shards-heldout"), Path("data/smollm2-regen/heldout.npz"))
USER_SETS = ("user-math", "user-code", "user-chat")
SETS = ("regen", "gsm-unseen") + USER_SETS
GSM_UNSEEN_SEED = 7  # reasoning-gym seed of the gsm-unseen set: not the benchmark's (0), not training's


def gsm_unseen_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat-formatted prompts of the gsm-unseen set (see the module docstring)."""
    eval_templates, _ = gsm_template_split()
    bench = {p.messages[-1]["content"].strip() for p in load_all()}
    out = []
    for _, q in gsm_symbolic_items(GSM_UNSEEN_SEED, 4 * n, eval_templates):
        if q.strip() not in bench:
            out.append(chat_token_ids(tokenizer, [{"role": "user", "content": q}]))
        if len(out) == n:
            break
    return out


def heldout_prompts(tokenizer, prompt_set: str, n: int, heldout: str | None) -> list[list[int]]:
    """The first n prompts of a prompt set (`SETS`, see the module docstring) as chat-formatted token ids."""
    if prompt_set == "gsm-unseen":
        return gsm_unseen_prompts(tokenizer, n)
    if prompt_set in USER_SETS:
        return [chat_token_ids(tokenizer, p.messages) for p in load_task(prompt_set)[:n]]
    if prompt_set != "regen":
        raise ValueError(f"prompt set must be one of {SETS}, got {prompt_set!r}")
    if heldout is None:
        found = [p for p in PACKAGED_HELDOUT if p.exists()]
        if not found:
            raise FileNotFoundError("no held-out records: pass --heldout DIR (a `blockdraft data` shards-heldout)")
        heldout = str(found[0])
    return [prompt_of(r) for r in load_records(heldout)[:n]]


def heldout_tau(target, drafts: list[tuple[str, str]], prompts: list[list[int]], max_new_tokens: int,
                block_size: int | None = None, draft_weights: str = "auto") -> list[dict]:
    """For each (name, draft directory): greedy decode every prompt at fixed width `block_size` (default: the
    draft's recommended decode block), the draft's fused weights in `draft_weights` (DecodeSpec) -> {tau,
    position-1 acceptance, acceptance per draft position, ...}."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    rows = []
    for name, path in drafts:
        eng = build_engine(target, load_draft(path, target),
                           DecodeSpec("dflash", block_size=block_size, draft_weights=draft_weights))
        steps = committed = 0
        acc: list[int] = []  # accepted / verified per draft position
        tri: list[int] = []
        for p in prompts:
            s = eng.generate(p, cfg).stats
            steps += len(s.accept_lengths)
            committed += sum(s.accept_lengths)
            for k, (a, t) in enumerate(zip(s.position_accepted, s.position_trials)):
                if k == len(acc):
                    acc.append(0)
                    tri.append(0)
                acc[k] += a
                tri[k] += t
        profile = [round(a / t, 4) if t else None for a, t in zip(acc, tri)]
        rows.append({"draft": name, "path": path, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                     "block_size": block_size, "draft_weights": eng.spec.draft_weights,
                     "tau": committed / max(1, steps),
                     "position1_acceptance": acc[0] / max(1, tri[0]) if tri else 0.0,
                     "position_acceptance": profile})
    return rows


@dataclass(frozen=True)
class HeldoutTauConfig:
    """`blockdraft heldout-tau`: drafts as (name, directory) pairs, all measured on the same prompts (prompts of
    prompt_set; heldout: the records of the `regen` set) at fixed width block_size (None: each draft's decode block),
    max_new_tokens each; the target on its weights mode, the drafts' fused weights draft_weights; threads: torch's
    (None: its choice); out: a file the rows are appended to as JSON lines."""

    drafts: tuple[tuple[str, str], ...]
    target: str | None = None
    prompt_set: str = "regen"
    block_size: int | None = None
    heldout: str | None = None
    prompts: int = 12
    max_new_tokens: int = 96
    weights: str = "auto"
    draft_weights: str = "auto"
    threads: int | None = None
    out: str | None = None


def run_heldout_tau(cfg: HeldoutTauConfig) -> list[dict]:
    """The rows of `heldout_tau`, each with the target, the prompt set and the weights mode; also appended to
    cfg.out."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target, _ = load_target(cfg.target, "bf16", weights=cfg.weights)
    prompts = heldout_prompts(target.tokenizer, cfg.prompt_set, cfg.prompts, cfg.heldout)
    rows = heldout_tau(target, list(cfg.drafts), prompts, cfg.max_new_tokens, cfg.block_size, cfg.draft_weights)
    for r in rows:
        r.update(target=cfg.target, set=cfg.prompt_set, weights=cfg.weights)
    if cfg.out:
        with open(cfg.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows
