"""Training checkpoints that survive a kill at any instant, and the resume side: which checkpoint to load, the exported
draft, the training log.

Layout: checkpoints/step-NNNNNNN/{draft.safetensors, optim.pt, config.json, state.json} plus checkpoints/latest, the
name of the newest complete one. A checkpoint is written into .tmp-step-N, every file and the directory are fsynced,
the directory is renamed into place and only then named in `latest` (itself replaced atomically), so a process killed
at any instant (SIGKILL, OOM killer, power loss) leaves `latest` naming a complete checkpoint, never a torn one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import torch

from ..models.draft import DFlashDraftModel

CKPT_FILES = ("draft.safetensors", "optim.pt", "config.json", "state.json")  # in write order: state.json last
LATEST = "latest"
FAULT_ENV = "BLOCKDRAFT_CKPT_FAULT"


def _fault_point(stage: str, step: int) -> None:
    """Test hook: SIGKILL this process at a named stage of a checkpoint write when $BLOCKDRAFT_CKPT_FAULT is `stage`
    or `stage@step`, so a fault test lands its kill mid-write deterministically (tests/test_train_faults.py)."""
    want = os.environ.get(FAULT_ENV)
    if want and want in (stage, f"{stage}@{step}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (what makes a rename durable), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _ckpt_dirs(out: Path) -> list[Path]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "state.json").is_file())


def _ckpt_problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be loaded (a missing file, a size other than the one state.json recorded), or None."""
    missing = [n for n in CKPT_FILES if not (ckpt / n).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        sizes = json.loads((ckpt / "state.json").read_text()).get("files", {})
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"state.json unreadable ({e})"
    wrong = [n for n, size in sizes.items() if (ckpt / n).stat().st_size != size]
    return f"{', '.join(wrong)} not the size state.json recorded" if wrong else None


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint a resumed run starts from: the one checkpoints/latest names, else (a run written before the
    pointer existed) the newest step directory. ValueError if that checkpoint is damaged."""
    root = out / "checkpoints"
    pointer = root / LATEST
    if pointer.is_file():
        ckpt = root / pointer.read_text().strip()
    else:
        dirs = _ckpt_dirs(out)
        if not dirs:
            return None
        ckpt = dirs[-1]
    problem = _ckpt_problem(ckpt)
    if problem:
        raise ValueError(f"checkpoint {ckpt} is damaged ({problem}): move it away (and {pointer}) to resume from an "
                         "earlier one")
    return ckpt


def save_checkpoint(out: Path, draft: DFlashDraftModel, opt, state: dict, keep_last: int) -> Path:
    """Write checkpoints/step-N atomically (module docstring), point `latest` at it, then keep the last
    `keep_last`."""
    from safetensors.torch import save_file

    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    step = state["step"]
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {k: (v.float() if v.is_floating_point() else v).detach().contiguous()
               for k, v in draft.state_dict().items()}
    save_file(weights, str(tmp / "draft.safetensors"))
    _fault_point("draft.safetensors", step)
    # (no scheduler state: the learning rate is a function of the step)
    torch.save({"optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / "optim.pt")
    _fault_point("optim.pt", step)
    (tmp / "config.json").write_text(json.dumps(draft.config.to_hf_dict(), indent=2))
    _fault_point("config.json", step)
    files = {n: (tmp / n).stat().st_size for n in CKPT_FILES[:-1]}
    (tmp / "state.json").write_text(json.dumps(dict(state, files=files), indent=2))
    _fault_point("state.json", step)
    for n in CKPT_FILES:
        _fsync(tmp / n)
    _fsync(tmp)
    if final.exists():  # the same step again (a resumed run replaying past a checkpoint `latest` did not name yet)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    _fault_point("renamed", step)
    _write_text_atomic(root / LATEST, final.name + "\n")
    _fault_point("latest", step)
    for junk in root.glob(".tmp-*"):  # left by runs killed mid-write or mid-prune
        if junk.is_dir():
            shutil.rmtree(junk, ignore_errors=True)
        else:
            junk.unlink(missing_ok=True)
    if keep_last > 0:
        keep = set(_ckpt_dirs(out)[-keep_last:]) | {final}
        # every other step-* directory goes, complete or not (an older run killed inside rmtree left one without
        # state.json); renamed first, so that a kill during the delete leaves .tmp-* junk, never a torn step-*
        for old in sorted(root.glob("step-*")):
            if old not in keep:
                doomed = root / f".tmp-del-{old.name}"
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
    return final


def export_draft(draft: DFlashDraftModel, path: Path) -> None:
    """save_pretrained into a temp directory, then swap it in: a kill never leaves a half-written draft at `path`
    (at worst, between the two renames, the previous export sits in .old-<name> and `path` is absent)."""
    tmp, old = path.with_name(f".tmp-{path.name}"), path.with_name(f".old-{path.name}")
    for p in (tmp, old):
        if p.exists():
            shutil.rmtree(p)
    draft.save_pretrained(tmp)
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(ckpt: Path, draft: DFlashDraftModel, opt) -> dict:
    """Restore model, optimizer and RNG from `ckpt` -> the training state (step, samples seen, config)."""
    from safetensors.torch import load_file

    draft.load_state_dict(load_file(str(ckpt / "draft.safetensors")))
    blob = torch.load(ckpt / "optim.pt", weights_only=False)
    opt.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    state = json.loads((ckpt / "state.json").read_text())
    state.pop("files", None)
    return state


def trim_log(path: Path, step: int) -> None:
    """On resume from `step`: drop the log entries of later steps (the resumed run writes them again) and a line
    torn by a kill, so train_log.jsonl / curve.jsonl read as one uninterrupted run."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("step", 0) <= step:
            kept.append(line + "\n")
    _write_text_atomic(path, "".join(kept))
