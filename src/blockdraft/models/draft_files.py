"""A draft's directory: config.json beside its safetensors weights (the layout vLLM and SGLang load), written so that
an interrupted save never leaves a truncated file, read with clear errors for what is missing or corrupt. DFlash and
EAGLE drafts share it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def write_draft_dir(out_dir: str | Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """config.json + model.safetensors, the weights written to a temporary file first (an interrupted save never
    leaves a truncated model.safetensors behind)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def read_draft_dir(path: str | Path, weights: str = WEIGHTS_NAME) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (config.json as a dict, the safetensors state of `weights`), with a clear error for a missing or corrupt
    file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{p} is not a draft directory (no {CONFIG_NAME})")
    try:
        d = json.loads((p / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p / CONFIG_NAME} is not valid JSON: {e}") from None
    if not (p / weights).is_file():
        raise FileNotFoundError(f"{p} has no {weights}")
    try:
        state = load_file(str(p / weights))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{p / weights} is not a readable safetensors file: {e}") from None
    return d, state


def load_checked(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Load `state` into `model`, turning missing/unexpected names and contradicting shapes into a ValueError."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # tensor shapes that contradict config.json
        raise ValueError(f"{source} does not match its config: {e}") from None
    if missing or unexpected:
        raise ValueError(f"{source} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
