"""The target's outputs over the training records, computed once and kept on disk.

A draft's training step needs, for every training sequence, the tapped target features and (for target labels or
distillation) the target's own next-token choice at every position. Computing them online costs a target forward
per sequence and step; on a 2-core CPU that is as much as the draft's own step. So one prefill pass writes them:

    <dir>/manifest.json          layer ids, hidden size, top-k, the chunks written so far (resumable)
    <dir>/chunk-NNNNN/           one folder per chunk of records, every array a plain .npy (memory-mapped on read):
        tokens.npy     [T] int32       the records' tokens, concatenated
        loss_mask.npy  [T] uint8       1 = response token
        offsets.npy    [n+1] int64     record k is rows offsets[k]:offsets[k+1]
        feats.npy      [T, K*H] uint16 the tapped layers' outputs, bf16 bits, in `layer_ids` order
        greedy.npy     [T] int32       greedy[t] = the target's argmax next token after position t (teacher-forced)
        topk_ids.npy   [T, k] int32    the target's k most likely next tokens after position t ...
        topk_logits.npy [T, k] float16 ... and their logits (distillation against the target's distribution)
        ids.json                       the record ids

A chunk folder is written under a temporary name and renamed when complete, and the manifest is rewritten after it,
so a killed run loses at most the chunk in progress and a re-run continues after the last complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

MANIFEST = "manifest.json"
ARRAYS = ("tokens", "loss_mask", "offsets", "feats", "greedy", "topk_ids", "topk_logits")


def build_teacher_cache(target, records: Sequence[dict], out_dir: str | Path, layer_ids: Sequence[int],
                        topk: int = 16, max_len: int = 512, chunk_records: int = 64,
                        log_every: int = 1, first_record: int = 0) -> Path:
    """Prefill the target over `records` (dicts with id / input_ids / loss_mask) and write the cache described in
    the module docstring. Re-running with the same arguments resumes; other layer ids / top-k / max_len than the
    manifest's are refused (the cache would mix two teachers). `first_record` says where `records` starts in the
    record set it was cut from (records appended after an earlier cache go in a cache of their own, and training
    reads the union): it is kept in the manifest, so that resuming with another slice is refused."""
    import logging
    import time

    log = logging.getLogger(__name__)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    man_path = out / MANIFEST
    spec = {"layer_ids": [int(i) for i in layer_ids], "topk": int(topk), "max_len": int(max_len),
            "hidden_size": int(target.hidden_size), "vocab_size": int(target.vocab_size),
            "first_record": int(first_record)}
    if man_path.exists():
        manifest = json.loads(man_path.read_text())
        # caches written before slices existed start at record 0
        old = {k: manifest.get(k, 0 if k == "first_record" else None) for k in spec}
        if old != spec:
            raise ValueError(f"{man_path} was written with {old}, this run asks for {spec}: use another directory")
    else:
        manifest = dict(spec, chunks=[], records=0)
    done = manifest["records"]
    if done > len(records):
        raise ValueError(f"{man_path} holds {done} records but only {len(records)} were given")
    target.set_layer_ids(spec["layer_ids"])
    t0, tokens_done = time.time(), 0
    for start in range(done, len(records), chunk_records):
        part = records[start:start + chunk_records]
        arrays = {k: [] for k in ARRAYS if k != "offsets"}
        offsets = [0]
        for rec in part:
            ids = torch.tensor(rec["input_ids"][:max_len], dtype=torch.long).unsqueeze(0)
            mask = np.asarray(rec["loss_mask"][:max_len], dtype=np.uint8)
            if ids.shape[1] != mask.shape[0]:
                raise ValueError(f"record {rec.get('id')!r}: input_ids and loss_mask lengths differ")
            hidden, feats = target.hidden(ids, None, tap=True)
            logits = target.logits(hidden)[0].float()  # [T, V]
            top = logits.topk(topk, dim=-1)
            arrays["tokens"].append(ids[0].numpy().astype(np.int32))
            arrays["loss_mask"].append(mask)
            arrays["feats"].append(feats[0].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
            arrays["greedy"].append(top.indices[:, 0].numpy().astype(np.int32))
            arrays["topk_ids"].append(top.indices.numpy().astype(np.int32))
            arrays["topk_logits"].append(top.values.numpy().astype(np.float16))
            offsets.append(offsets[-1] + ids.shape[1])
        name = f"chunk-{len(manifest['chunks']):05d}"
        tmp = out / f".tmp-{name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for k, v in arrays.items():
            np.save(tmp / f"{k}.npy", np.concatenate(v))
        np.save(tmp / "offsets.npy", np.asarray(offsets, dtype=np.int64))
        (tmp / "ids.json").write_text(json.dumps([str(r.get("id", start + i)) for i, r in enumerate(part)]))
        if (out / name).exists():
            shutil.rmtree(out / name)
        os.replace(tmp, out / name)
        manifest["chunks"].append(name)
        manifest["records"] = start + len(part)
        tmp_man = out / (MANIFEST + ".tmp")
        tmp_man.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp_man, man_path)
        tokens_done += offsets[-1]
        if log_every and len(manifest["chunks"]) % log_every == 0:
            log.info("teacher cache: %d / %d records, %.0f tokens/s", manifest["records"], len(records),
                     tokens_done / max(1e-9, time.time() - t0))
    return out


@dataclass
class TeacherSequence:
    """One record's cached target outputs (views into memory-mapped arrays; nothing is copied until used)."""
    id: str
    tokens: np.ndarray  # [L] int32
    loss_mask: np.ndarray  # [L] uint8
    feats: np.ndarray  # [L, K*H] uint16 (bf16 bits)
    greedy: np.ndarray  # [L] int32
    topk_ids: np.ndarray  # [L, k] int32
    topk_logits: np.ndarray  # [L, k] float16

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class TeacherCache:
    """Reads a cache written by `build_teacher_cache` (all chunks, memory-mapped)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        man = self.dir / MANIFEST
        if not man.is_file():
            raise FileNotFoundError(f"no teacher cache at {self.dir} (missing {MANIFEST}): build it first")
        try:
            self.manifest = json.loads(man.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{man} is not valid JSON: {e}") from None
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.sequences: list[TeacherSequence] = []
        for name in self.manifest["chunks"]:
            d = self.dir / name
            try:
                arr = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ARRAYS}
                ids = json.loads((d / "ids.json").read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"teacher cache chunk {d} is unreadable: {e}") from None
            off = arr["offsets"]
            if len(off) != len(ids) + 1 or off[-1] != len(arr["tokens"]) or arr["feats"].shape[0] != off[-1]:
                raise ValueError(f"teacher cache chunk {d}: inconsistent array lengths")
            for k, rid in enumerate(ids):
                s = slice(int(off[k]), int(off[k + 1]))
                self.sequences.append(TeacherSequence(rid, arr["tokens"][s], arr["loss_mask"][s], arr["feats"][s],
                                                      arr["greedy"][s], arr["topk_ids"][s], arr["topk_logits"][s]))

    def __len__(self) -> int:
        return len(self.sequences)

    def columns(self, layer_ids: Sequence[int]) -> np.ndarray:
        """Column indices of `feats` holding the given layers, in the given order -> [len * H] int64."""
        h = self.hidden_size
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise ValueError(f"teacher cache {self.dir} has layers {self.layer_ids}, not {missing}")
        return np.concatenate([np.arange(h) + self.layer_ids.index(i) * h for i in layer_ids])


def feats_tensor(seq: TeacherSequence, cols: np.ndarray | None = None) -> torch.Tensor:
    """[L, K*H] bf16 tensor of a sequence's features (optionally only the columns `cols`)."""
    f = np.array(seq.feats if cols is None else seq.feats[:, cols])  # a writable copy out of the memory map
    return torch.from_numpy(f.view(np.int16)).view(torch.bfloat16)
