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
- `user-math`, `user-code`, `user-chat`: the prompts written the way users write them (`eval/tasks/realistic.py`),
  never trained on and sharing no template with training: how a draft generalises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PACKAGED_HELDOUT = (Path("data/work/regen-smollm2/shards-heldout"), Path("data/smollm2-regen/heldout.npz"))
# the model, decode and training code are imported inside the functions: the CLI imports this module only to
# register the subcommand
USER_SETS = ("user-math", "user-code", "user-chat")
SETS = ("regen", "gsm-unseen") + USER_SETS
GSM_UNSEEN_SEED = 7  # reasoning-gym seed of the gsm-unseen set: not the benchmark's (0), not training's


def gsm_unseen_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat-formatted prompts of the gsm-unseen set (see the module docstring)."""
    from ..train.data import chat_token_ids
    from .tasks.math import gsm_symbolic_items, gsm_template_split, load_all

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
    from ..train.live import prompt_of
    from ..train.records import load_records

    if prompt_set == "gsm-unseen":
        return gsm_unseen_prompts(tokenizer, n)
    if prompt_set in USER_SETS:
        from ..train.data import chat_token_ids
        from .tasks import load_task

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
                block_size: int | None = None) -> list[dict]:
    """For each (name, draft directory): greedy decode every prompt at fixed width `block_size` (default: the
    draft's recommended decode block) -> {tau, position-1 acceptance, acceptance per draft position, ...}."""
    from ..config import GenerationConfig
    from ..loading import build_engine

    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    rows = []
    for name, path in drafts:
        eng = build_engine(target, Path(path), block_size=block_size)
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
                     "block_size": block_size, "tau": committed / max(1, steps),
                     "position1_acceptance": acc[0] / max(1, tri[0]) if tri else 0.0,
                     "position_acceptance": profile})
    return rows


def cmd_heldout_tau(args) -> int:
    import torch

    from ..loading import load_target

    drafts = []
    for spec in args.draft:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--draft takes NAME=DIR, got {spec!r}")
        drafts.append((name, path))
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target(args.target, "bf16", weights=args.weights)
    prompts = heldout_prompts(target.tokenizer, args.set, args.prompts, args.heldout)
    rows = heldout_tau(target, drafts, prompts, args.max_new_tokens, args.block_size)
    for r in rows:
        r.update(target=args.target, set=args.set, weights=args.weights)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def register(sub) -> None:
    p = sub.add_parser("heldout-tau", help="held-out tau of several drafts in one run (greedy, the real engine)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", action="append", required=True, metavar="NAME=DIR", help="repeatable")
    p.add_argument("--target", default=None, help="the drafts' target (a path, a hub id or an alias)")
    p.add_argument("--set", default="regen", choices=SETS, help="prompt set (see above)")
    p.add_argument("--block-size", type=int, default=None,
                   help="decode block (fixed width; default: each draft's recommended decode block)")
    p.add_argument("--heldout", default=None, help="held-out records for --set regen")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--weights", default="auto", choices=["auto", "bf16", "int8", "int4"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="append the results as JSON lines to this file")
    p.set_defaults(func=cmd_heldout_tau)
