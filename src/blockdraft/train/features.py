"""Target hidden-state features for training: computed online per batch, or precomputed offline into shards.

Both give [1, L, K*H] tensors (bf16 offline) of the tapped layers' outputs for one training sequence; a test checks
that the two modes yield the same training batches.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file

from ..models.draft import DFlashDraftModel
from ..models.eagle import EagleDraftModel, is_eagle_draft
from ..models.loading import load_target
from ..models.target import TargetModel
from .records import load_records

MANIFEST = "manifest.json"


class OnlineFeatures:
    """The target computes features for each training sequence (no grad)."""

    def __init__(self, target: TargetModel, layer_ids) -> None:
        self.target = target
        target.set_layer_ids(layer_ids)

    def __call__(self, record: dict) -> torch.Tensor:
        ids = torch.tensor(record["input_ids"], dtype=torch.long, device=self.target.device).unsqueeze(0)
        return self.target(ids, None, last_only=True, tap=True).features

    def batch(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S, L] right-padded sequences -> features [S, L, K*H] (rows past a sequence's end are padding: the
        target is causal, so they never change a real position's features)."""
        return self.target.hidden(ids.to(self.target.device), None, tap=True)[1]

    def with_greedy(self, record: dict, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features [1, L, K*H], greedy [L]): greedy[t] is the target's argmax next token after position t,
        from the same forward (one extra [L, V] LM-head product)."""
        ids = torch.tensor(record["input_ids"][:max_len], dtype=torch.long, device=self.target.device).unsqueeze(0)
        out = self.target(ids, None, tap=True)
        return out.features, out.logits[0].argmax(-1)


def precompute_features(target: TargetModel, layer_ids, records: Iterable[dict], out_dir: str | Path,
                        shard_size: int = 256, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write features of every record into safetensors shards (`feats-00000.safetensors`, one tensor per record id)
    plus a manifest mapping id -> shard. Resumable: finished shards are kept, the manifest is rewritten at the end
    of each shard (atomically), so a killed run loses at most one shard."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    man_path = out / MANIFEST
    manifest = json.loads(man_path.read_text()) if man_path.exists() else {
        "layer_ids": list(layer_ids), "dtype": str(dtype), "index": {}}
    if manifest["layer_ids"] != list(layer_ids):
        raise ValueError(f"{man_path} was written for layers {manifest['layer_ids']}, not {list(layer_ids)}")
    online = OnlineFeatures(target, layer_ids)
    pending: dict[str, torch.Tensor] = {}
    shard = len({v for v in manifest["index"].values()})

    def flush() -> None:
        nonlocal shard, pending
        if not pending:
            return
        name = f"feats-{shard:05d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file(pending, str(tmp))
        os.replace(tmp, out / name)
        for k in pending:
            manifest["index"][k] = name
        tmp_man = out / (MANIFEST + ".tmp")
        tmp_man.write_text(json.dumps(manifest))
        os.replace(tmp_man, man_path)
        shard += 1
        pending = {}

    for rec in records:
        key = str(rec["id"])
        if key in manifest["index"] or key in pending:
            continue
        pending[key] = online(rec)[0].to(dtype).contiguous()
        if len(pending) >= shard_size:
            flush()
    flush()
    return out


class OfflineFeatures:
    """Reads features written by `precompute_features`; keeps the most recently used shard in memory."""

    def __init__(self, directory: str | Path, layer_ids=None) -> None:
        self.dir = Path(directory)
        man = self.dir / MANIFEST
        if not man.is_file():
            raise FileNotFoundError(f"no feature manifest at {man}: run `blockdraft features` first")
        self.manifest = json.loads(man.read_text())
        if layer_ids is not None and list(layer_ids) != self.manifest["layer_ids"]:
            raise ValueError(f"features in {self.dir} are for layers {self.manifest['layer_ids']}, "
                             f"the draft wants {list(layer_ids)}")
        self._name: str | None = None
        self._shard: dict[str, torch.Tensor] = {}

    def __call__(self, record: dict) -> torch.Tensor:
        key = str(record["id"])
        name = self.manifest["index"].get(key)
        if name is None:
            raise KeyError(f"no precomputed features for record {key!r} in {self.dir}")
        if name != self._name:
            self._shard = load_file(str(self.dir / name))
            self._name = name
        return self._shard[key].unsqueeze(0)


@dataclass(frozen=True)
class FeaturesConfig:
    """`blockdraft features`: the records (data) whose target features are written to out, for the layers of a
    draft's config (draft) or the given layer_ids."""

    data: str
    out: str
    target: str | None = None
    draft: str | None = None
    layer_ids: tuple[int, ...] | None = None
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if not self.draft and self.layer_ids is None:
            raise ValueError("which target layers: pass --draft DIR (its layers) or --layer-ids")


def write_features(cfg: FeaturesConfig) -> list[int]:
    """Precompute the features of cfg.data into cfg.out; returns the tapped layer ids."""
    target, _ = load_target(cfg.target, cfg.dtype, weights="bf16")  # training reads the float model
    draft_cls = EagleDraftModel if cfg.draft and is_eagle_draft(cfg.draft) else DFlashDraftModel
    layer_ids = (list(draft_cls.from_pretrained(cfg.draft).config.target_layer_ids) if cfg.draft
                 else list(cfg.layer_ids))
    precompute_features(target, layer_ids, load_records(cfg.data), cfg.out)
    return layer_ids
