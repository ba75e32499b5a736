"""What a result was measured with, written into every results file: code, draft, target, command and machine.

A draft directory keeps its path while its weights change, so a result names the draft by a hash of its files;
the target's weights file likewise (a GGUF or a safetensors directory); the code by its git commit and whether the
work tree had uncommitted changes.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import platform
import subprocess
from pathlib import Path

_CHUNK = 1 << 20


def files_sha256(paths: list[Path]) -> str:
    """sha256 over the files in the given order (name, then bytes, for each), hex."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
    return h.hexdigest()


def dir_sha256(directory: str | Path | None) -> str | None:
    """The hash of a model directory's files (config, weights, tokenizer, ...: every regular file, sorted by name;
    None for no directory). Files that are not part of the model (a model card) are included too: cheap to hash,
    and a changed card is still the same weights only by convention."""
    if directory is None:
        return None
    d = Path(directory)
    if d.is_file():
        return files_sha256([d])
    if not d.is_dir():
        return None
    return files_sha256(sorted(p for p in d.iterdir() if p.is_file()))


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_manifest(*, command: str, draft: str | Path | None, target_file: str | Path | None,
                 weights: dict | None = None) -> dict:
    """The manifest of one run: git commit and dirty flag, the draft's and the target file's sha256, the command,
    torch version, threads, CPU model, date, and the weights plan when given."""
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status),
        "draft": None if draft is None else str(draft), "draft_sha256": dir_sha256(draft),
        "target_file": None if target_file is None else str(target_file),
        "target_sha256": dir_sha256(target_file), "command": command, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "weights": weights,
    }


def config_command(subcommand: str, cfg) -> str:
    """The `blockdraft SUBCOMMAND` command line of a tool's config (a dataclass whose fields are its flags): every
    field set, defaults included, so the record still says what ran after a default changes; `out` left out."""
    parts = [f"blockdraft {subcommand}"]
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None or v is False or f.name == "out":
            continue
        flag = "--" + f.name.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {','.join(map(str, v)) if isinstance(v, tuple) else v}")
    return " ".join(parts)
