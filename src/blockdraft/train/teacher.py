"""The target's outputs over the training records, computed once and kept on disk.

A draft's training step needs, for every training sequence, the tapped target features and (for target labels or
distillation) the target's own next-token choice at every position. Computing them online costs a target forward
per sequence and step; on a 2-core CPU that is as much as the draft's own step. So one prefill pass writes them:

    <dir>/manifest.json          layer ids, hidden size, top-k, the chunks written so far (resumable)
    <dir>/chunk-NNNNN/           one folder per chunk of records, every array a plain .npy (memory-mapped on read):
        tokens.npy     [T] int32       the records' tokens, concatenated
        loss_mask.npy  [T] uint8       1 = response token
        offsets.npy    [n+1] int64     record k is rows offsets[k]:offsets[k+1]
        feats.npy      [T, K*H] uint16 the tapped layers' outputs, bf16 bits, in `layer_ids` order; or, in a cache
                                       written with feats "int8", int8 codes with...
        feats_scale.npy [T, K*H/32] float32 ... a scale per position and block of 32 values (max |x| / 127),
                                       as the kernels quantize activations: 56% of the bytes
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

from ..models.draft_config import default_target_layer_ids
from ..models.loading import load_target
from .precision import compute_dtype, dtype_name
from .records import load_records

MANIFEST = "manifest.json"
ARRAYS = ("tokens", "loss_mask", "offsets", "feats", "greedy", "topk_ids", "topk_logits")
FEATS = ("bf16", "int8")  # how feats.npy holds the features
FEATS_GROUP = 32  # int8 features: values per scale (a tapped layer's few huge channels would coarsen a whole row)
# what a cache written before a spec key existed holds; source: whose prefill wrote it (float: the HF modules,
# decode: the decode path, regeneration: the answers' own pass)
SPEC_DEFAULTS = {"first_record": 0, "feats": "bf16", "source": "float"}


class TeacherCacheWriter:
    """Appends records' teacher arrays to a cache directory in chunks (the layout above), resumably: `spec` is
    kept in the manifest and a directory written with another spec is refused (the cache would mix two teachers).
    `done` holds the ids already written."""

    def __init__(self, out_dir: str | Path, spec: dict) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.man_path = self.out / MANIFEST
        self.spec = spec
        if self.man_path.exists():
            manifest = json.loads(self.man_path.read_text())
            old = {k: manifest.get(k, SPEC_DEFAULTS.get(k)) for k in spec}
            if old != spec:
                raise ValueError(f"{self.man_path} was written with {old}, this run asks for {spec}: use another "
                                 "directory")
        else:
            manifest = dict(spec, chunks=[], records=0)
        self.manifest = manifest
        self.done: set[str] = set()
        for name in manifest["chunks"]:
            self.done.update(json.loads((self.out / name / "ids.json").read_text()))

    @property
    def records(self) -> int:
        return int(self.manifest["records"])

    def write_chunk(self, ids: list[str], arrays: dict[str, list[np.ndarray]], lengths: list[int]) -> None:
        """One chunk: `arrays` holds each of ARRAYS but offsets, one array per record (of `lengths`)."""
        name = f"chunk-{len(self.manifest['chunks']):05d}"
        tmp = self.out / f".tmp-{name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for k, v in arrays.items():
            np.save(tmp / f"{k}.npy", np.concatenate(v))
        np.save(tmp / "offsets.npy", np.cumsum([0] + list(lengths)).astype(np.int64))
        (tmp / "ids.json").write_text(json.dumps(ids))
        if (self.out / name).exists():
            shutil.rmtree(self.out / name)
        os.replace(tmp, self.out / name)
        self.manifest["chunks"].append(name)
        self.manifest["records"] = self.records + len(ids)
        tmp_man = self.out / (MANIFEST + ".tmp")
        tmp_man.write_text(json.dumps(self.manifest, indent=1))
        os.replace(tmp_man, self.man_path)
        self.done.update(ids)


def teacher_spec(target, layer_ids: Sequence[int], topk: int, max_len: int, first_record: int = 0,
                 feats: str = "bf16") -> dict:
    """What a cache's arrays depend on, kept in its manifest."""
    if feats not in FEATS:
        raise ValueError(f"feats must be one of {FEATS}, got {feats!r}")
    return {"layer_ids": [int(i) for i in layer_ids], "topk": int(topk), "max_len": int(max_len),
            "hidden_size": int(target.hidden_size), "vocab_size": int(target.vocab_size),
            "first_record": int(first_record), "feats": feats}


def pack_features(x: torch.Tensor, feats: str) -> dict[str, np.ndarray]:
    """x [T, K*H] (any float) -> the arrays a cache holds for it: {"feats": bf16 bits} or, for "int8", int8 codes
    and a float32 scale per position and FEATS_GROUP values (max |x| / 127, codes rounded to nearest)."""
    if feats == "bf16":
        return {"feats": bf16_bits(x)}
    t = x.shape[0]
    v = x.float().reshape(t, -1, FEATS_GROUP)
    scale = v.abs().amax(-1) / 127  # [T, K*H/32]
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = (v * inv[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(t, -1)
    return {"feats": codes.numpy(), "feats_scale": scale.numpy().astype(np.float32)}


def build_teacher_cache(target, records: Sequence[dict], out_dir: str | Path, layer_ids: Sequence[int],
                        topk: int = 16, max_len: int = 512, chunk_records: int = 64,
                        log_every: int = 1, first_record: int = 0, feats: str = "bf16",
                        decode_path: bool = False) -> Path:
    """Prefill the target over `records` (dicts with id / input_ids / loss_mask) and write the cache described in
    the module docstring. Re-running with the same arguments resumes; other layer ids / top-k / max_len than the
    manifest's are refused (the cache would mix two teachers). `first_record` says where `records` starts in the
    record set it was cut from (records appended after an earlier cache go in a cache of their own, and training
    reads the union): it is kept in the manifest, so that resuming with another slice is refused. feats: how the
    features are held (`FEATS`: bf16, or int8 codes with a scale per position and layer). decode_path: prefill
    through the target's decode path (its fused weights, a GGUF's own quantized blocks on the native kernels) instead
    of its float HF modules: the features `blockdraft data --record-layers` records in the answers' pass, bit for bit
    (a T-token forward gives the bits of T one-token steps), so answers kept without their teacher data regain it;
    on a CPU it is also the faster prefill. Kept in the manifest (`source: decode`): the two are not mixed."""
    import logging
    import time

    log = logging.getLogger(__name__)
    spec = teacher_spec(target, layer_ids, topk, max_len, first_record, feats)
    if decode_path and target.lean is None:
        raise ValueError(f"decode_path: this target has no fused decode path ({target.lean_reason})")
    spec["source"] = "decode" if decode_path else "float"
    writer = TeacherCacheWriter(out_dir, spec)
    done = writer.records
    if done > len(records):
        raise ValueError(f"{writer.man_path} holds {done} records but only {len(records)} were given")
    target.set_layer_ids(spec["layer_ids"])
    t0, tokens_done = time.time(), 0
    for start in range(done, len(records), chunk_records):
        part = records[start:start + chunk_records]
        arrays: dict[str, list] = {}
        lengths = []
        for rec in part:
            ids = torch.tensor(rec["input_ids"][:max_len], dtype=torch.long).unsqueeze(0)
            mask = np.asarray(rec["loss_mask"][:max_len], dtype=np.uint8)
            if ids.shape[1] != mask.shape[0]:
                raise ValueError(f"record {rec.get('id')!r}: input_ids and loss_mask lengths differ")
            if decode_path:
                out = target.forward(ids, target.new_decode_cache(ids.shape[1] + 1), tap=True)
                feats_, logits = out.features, out.logits[0].float()  # [1, T, K*H], [T, V]
            else:
                hidden, feats_ = target.hidden(ids, None, tap=True)
                logits = target.logits(hidden)[0].float()  # [T, V]
            top = logits.topk(topk, dim=-1)
            one = {"tokens": ids[0].numpy().astype(np.int32), "loss_mask": mask,
                   **pack_features(feats_[0], feats),
                   "greedy": top.indices[:, 0].numpy().astype(np.int32),
                   "topk_ids": top.indices.numpy().astype(np.int32),
                   "topk_logits": top.values.numpy().astype(np.float16)}
            for k, v in one.items():
                arrays.setdefault(k, []).append(v)
            lengths.append(ids.shape[1])
        writer.write_chunk([str(r.get("id", start + i)) for i, r in enumerate(part)], arrays, lengths)
        tokens_done += sum(lengths)
        if log_every and len(writer.manifest["chunks"]) % log_every == 0:
            log.info("teacher cache: %d / %d records, %.0f tokens/s", writer.records, len(records),
                     tokens_done / max(1e-9, time.time() - t0))
    return writer.out


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    """x [..] (any float) -> its bf16 bits as uint16 (what `feats.npy` holds)."""
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def recorded_arrays(tokens: list[int], loss_mask: list[int], feats: torch.Tensor, topk_ids: torch.Tensor,
                    topk_logits: torch.Tensor, first_logit: int, topk: int, max_len: int,
                    feats_mode: str = "bf16") -> dict[str, np.ndarray]:
    """One record's arrays from what decoding recorded (`decode.proposers.record.FeatureRecorder`): feats [P, K*H]
    of positions 0 .. P-1, top-k [Q, k] of positions first_logit .. first_logit + Q - 1; cut to max_len. Positions
    the pass never computed (the final token's features; the logits before the prompt's last position, which no
    training anchor reads) are zeros, and greedy -1 there (no token equals it). feats_mode: as `pack_features`."""
    n = min(len(tokens), max_len)
    f = torch.zeros(n, feats.shape[1], dtype=torch.bfloat16)
    m = min(n, feats.shape[0])
    f[:m] = feats[:m].to(torch.bfloat16)
    ids = torch.full((n, topk), -1, dtype=torch.long)
    lg = torch.zeros(n, topk)
    q = max(0, min(n - first_logit, topk_ids.shape[0]))
    ids[first_logit:first_logit + q, :topk_ids.shape[1]] = topk_ids[:q]
    lg[first_logit:first_logit + q, :topk_logits.shape[1]] = topk_logits[:q]
    return {"tokens": np.asarray(tokens[:n], dtype=np.int32), "loss_mask": np.asarray(loss_mask[:n], dtype=np.uint8),
            **pack_features(f, feats_mode), "greedy": ids[:, 0].numpy().astype(np.int32),
            "topk_ids": ids.numpy().astype(np.int32), "topk_logits": lg.numpy().astype(np.float16)}


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
    feats_scale: np.ndarray | None = None  # [L, K*H/32] float32 when feats holds int8 codes

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
        self.feats = self.manifest.get("feats", SPEC_DEFAULTS["feats"])
        names = ARRAYS + (("feats_scale",) if self.feats == "int8" else ())
        for name in self.manifest["chunks"]:
            d = self.dir / name
            try:
                arr = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in names}
                ids = json.loads((d / "ids.json").read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"teacher cache chunk {d} is unreadable: {e}") from None
            off = arr["offsets"]
            scales = arr.get("feats_scale")
            if len(off) != len(ids) + 1 or off[-1] != len(arr["tokens"]) or arr["feats"].shape[0] != off[-1] or (
                    scales is not None and scales.shape != (off[-1], arr["feats"].shape[1] // FEATS_GROUP)):
                raise ValueError(f"teacher cache chunk {d}: inconsistent array lengths")
            for k, rid in enumerate(ids):
                s = slice(int(off[k]), int(off[k + 1]))
                self.sequences.append(TeacherSequence(
                    rid, arr["tokens"][s], arr["loss_mask"][s], arr["feats"][s], arr["greedy"][s],
                    arr["topk_ids"][s], arr["topk_logits"][s], None if scales is None else scales[s]))

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
    """[L, K*H] bf16 tensor of a sequence's features (optionally only the columns `cols`); int8 codes are scaled
    back per position and group of FEATS_GROUP values."""
    f = np.array(seq.feats if cols is None else seq.feats[:, cols])  # a writable copy out of the memory map
    if seq.feats_scale is None:
        return torch.from_numpy(f.view(np.int16)).view(torch.bfloat16)
    group = (np.arange(seq.feats.shape[1]) if cols is None else np.asarray(cols)) // FEATS_GROUP
    return torch.from_numpy(f.astype(np.float32) * np.asarray(seq.feats_scale)[:, group]).to(torch.bfloat16)


@dataclass(frozen=True)
class TeacherCacheConfig:
    """`blockdraft teacher-cache`: the records (data) cached into out: the features of layer_ids (None: 6 spread over
    the target's depth), greedy labels and topk logits, sequences cut at max_len; limit records (None: all) from
    offset on; threads: torch's (None: its choice); dtype: the prefill's float type (auto: bf16 where the CPU
    multiplies it natively, else fp32); feats: how the features are held (`FEATS`)."""

    data: str
    out: str
    target: str | None = None
    layer_ids: tuple[int, ...] | None = None
    topk: int = 16
    max_len: int = 512
    limit: int | None = None
    offset: int = 0
    threads: int | None = None
    dtype: str = "auto"
    feats: str = "bf16"
    weights: str = "bf16"  # bf16: the float HF modules; auto: the decode path on the target's own weights

    def __post_init__(self) -> None:
        if self.offset < 0 or (self.limit is not None and self.limit < 0):
            raise ValueError("--offset and --limit must be >= 0")
        if self.feats not in FEATS:
            raise ValueError(f"--feats must be one of {FEATS}, got {self.feats!r}")
        if self.weights not in ("bf16", "auto"):
            raise ValueError(f"--weights must be bf16 or auto, got {self.weights!r}")


def run_teacher_cache(cfg: TeacherCacheConfig) -> dict:
    """Cache cfg's slice of records (resumable, `build_teacher_cache`); returns where, how many and which layers."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    records = load_records(cfg.data)
    if cfg.offset > len(records):
        raise ValueError(f"--offset {cfg.offset}: {cfg.data} holds only {len(records)} records")
    end = None if cfg.limit is None else cfg.offset + cfg.limit
    records = records[cfg.offset:end]
    # training reads the float model; its prefill is compute-bound, so fp32 where bf16 matmuls are emulated
    target, _ = load_target(cfg.target, dtype_name(compute_dtype(cfg.dtype)), weights=cfg.weights)
    layers = list(cfg.layer_ids) if cfg.layer_ids else default_target_layer_ids(
        int(target.config.num_hidden_layers), 6)
    out = build_teacher_cache(target, records, cfg.out, layers, topk=cfg.topk, max_len=cfg.max_len,
                              first_record=cfg.offset, feats=cfg.feats, decode_path=cfg.weights == "auto")
    return {"out": str(out), "records": len(records), "first_record": cfg.offset, "layer_ids": layers}
