"""Training records on disk: resumable JSONL shards (one record per line, written atomically per line, read back
with file:line errors) and the compact uint16 `.npz` packing the repository commits. Split from `data.py`, which
builds prompt sets and regenerates answers into these shards.

Record format (one JSON object per line in `shard-NNNNN.jsonl`)::

    {"id": str, "input_ids": [prompt tokens + response tokens], "loss_mask": [0 per prompt token, 1 per response token]}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import logging
log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------------------------------------------

SHARD_GLOB = "shard-*.jsonl"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.jsonl"


def validate_record(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    for k in ("id", "input_ids", "loss_mask"):
        if k not in obj:
            raise ValueError(f"{where}: record is missing key {k!r}")
    ids, mask = obj["input_ids"], obj["loss_mask"]
    if not isinstance(obj["id"], str):
        raise ValueError(f"{where}: 'id' must be a string")
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(f"{where}: 'input_ids' must be a list of non-negative ints")
    if not isinstance(mask, list) or not all(m in (0, 1) and type(m) is int for m in mask):
        raise ValueError(f"{where}: 'loss_mask' must be a list of 0/1")
    if len(ids) != len(mask):
        raise ValueError(f"{where}: len(input_ids)={len(ids)} != len(loss_mask)={len(mask)}")
    return obj


def _shard_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(SHARD_GLOB))


def _parse_shard_line(raw: bytes, where: str) -> dict | None:
    """One line of a shard -> its validated record (None for a blank line). Anything else raises ValueError starting
    with `where` ("file:line"), plus the record's id when the line decodes that far."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte {e.start} of the line): the shard is corrupt") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        why = f"invalid JSON ({e.msg} at column {e.colno})"
        if "\x00" in line:  # what a crash leaves where appended data never reached the disk
            why += "; NUL bytes: the shard was cut by a crash"
        elif not raw.endswith(b"\n"):
            why += "; the last line is cut short: the shard is truncated"
        raise ValueError(f"{where}: {why}") from None
    if isinstance(obj, dict) and isinstance(obj.get("id"), str):
        where = f"{where} (record {obj['id']!r})"
    return validate_record(obj, where)


def read_shards(directory: str | Path) -> Iterator[dict]:
    """Yield every record of `directory/shard-*.jsonl` in order, validated. A corrupt or truncated line (bad bytes,
    bad JSON, missing key, input_ids/loss_mask length mismatch) raises ValueError naming the file, the line number
    and, when readable, the record's id."""
    for path in _shard_files(Path(directory)):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                rec = _parse_shard_line(raw, f"{path}:{lineno}")
                if rec is not None:
                    yield rec


class ShardWriter:
    """Appends records to shard files of `shard_size` lines. On open it scans the existing shards: an unterminated
    last line (a write cut by a kill) is truncated away; every complete line must be a valid record."""

    def __init__(self, directory: Path, shard_size: int):
        self.dir = directory
        self.shard_size = shard_size
        self.dir.mkdir(parents=True, exist_ok=True)
        self.done: set[str] = set()
        self.truncated_bytes = 0
        files = _shard_files(self.dir)
        count = 0
        for path in files:
            count = self._scan(path)
        if files:
            self.index = int(files[-1].stem.split("-")[-1])
            self.count = count
        else:
            self.index, self.count = 0, 0
        self.f = None

    def _scan(self, path: Path) -> int:
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: dropping a partially written last line (%d bytes)", path, len(data) - end)
            self.truncated_bytes += len(data) - end
            with open(path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        n = 0
        for lineno, raw in enumerate(data[:end].split(b"\n"), 1):  # "\n" only, as file iteration splits
            rec = _parse_shard_line(raw + b"\n", f"{path}:{lineno}")
            if rec is not None:
                self.done.add(rec["id"])
                n += 1
        return n

    def write(self, records: list[dict]) -> None:
        for rec in records:
            if self.f is None or self.count >= self.shard_size:
                if self.f is not None:
                    self._sync()
                    self.f.close()
                    self.index += 1
                    self.count = 0
                self.f = open(self.dir / shard_name(self.index), "a", encoding="utf-8")
            self.f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self.count += 1
            self.done.add(rec["id"])
        if self.f is not None:
            self._sync()

    def _sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.f is not None:
            self._sync()
            self.f.close()
            self.f = None


# ----------------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------------

UINT16_MAX = 65535


def pack_uint16(records: Iterable[dict], out_path: str | Path, vocab_size: int | None = None) -> int:
    """Store records in one compressed `.npz`: `tokens` (flat uint16), `loss_mask` (flat uint8), `offsets` (int64,
    n+1; record k is tokens[offsets[k]:offsets[k+1]]) and `ids` (unicode). Raises ValueError if the vocabulary
    (or any token id) does not fit in uint16. Written atomically; returns the number of records."""
    import numpy as np

    if vocab_size is not None and vocab_size > UINT16_MAX + 1:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint16 packing (max {UINT16_MAX + 1} tokens)")
    toks, masks, lens, ids = [], [], [], []
    for k, rec in enumerate(records):
        validate_record(rec, f"record {k}")
        t = np.asarray(rec["input_ids"], dtype=np.int64)
        if t.size and t.max() > UINT16_MAX:
            raise ValueError(f"record {rec['id']!r}: token id {int(t.max())} does not fit uint16 (vocab > 65535); "
                             "keep the JSONL shards for this tokenizer")
        toks.append(t.astype(np.uint16))
        masks.append(np.asarray(rec["loss_mask"], dtype=np.uint8))
        lens.append(t.size)
        ids.append(rec["id"])
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f, tokens=np.concatenate(toks) if toks else np.zeros(0, np.uint16),
            loss_mask=np.concatenate(masks) if masks else np.zeros(0, np.uint8), offsets=offsets,
            ids=np.array(ids, dtype=str) if ids else np.zeros(0, dtype="<U1"))
    os.replace(tmp, out_path)
    return len(ids)


PACKED_ARRAYS = ("tokens", "loss_mask", "offsets", "ids")


def _read_packed_arrays(path: Path) -> dict:
    """The arrays of a packed `.npz`; ValueError naming the file (and the array) if it is truncated or corrupt."""
    import zipfile
    import zlib

    import numpy as np

    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:  # a truncated zip loses its directory first
        raise ValueError(f"{path}: not a readable .npz, truncated or corrupt ({e})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: a single array, not a packed .npz of records")
    with z:
        missing = [n for n in PACKED_ARRAYS if n not in z.files]
        if missing:
            raise ValueError(f"{path}: not a packed record file: no array {', '.join(missing)} (has {z.files})")
        out = {}
        for name in PACKED_ARRAYS:
            try:
                out[name] = z[name]
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:  # bad CRC, cut deflate
                raise ValueError(f"{path}: array {name!r} is truncated or corrupt ({e})") from None
    return out


def load_packed(path: str | Path) -> list[dict]:
    """Records back from `pack_uint16`'s file (input_ids / loss_mask as lists of int). A truncated or corrupt file
    raises ValueError naming the file and the array; arrays that disagree, naming the first bad record."""
    import numpy as np

    a = _read_packed_arrays(Path(path))
    tokens, mask, offsets, ids = (a[n] for n in PACKED_ARRAYS)
    if any(x.ndim != 1 for x in a.values()) or ids.dtype.kind != "U" or any(
            x.dtype.kind not in "iu" for x in (tokens, mask, offsets)):
        raise ValueError(f"{path}: packed arrays of the wrong shape or type "
                         f"({ {n: (x.dtype.str, x.shape) for n, x in a.items()} })")
    if (len(offsets) != len(ids) + 1 or len(mask) != len(tokens) or offsets[0] != 0
            or offsets[-1] != len(tokens)):
        raise ValueError(f"{path}: {len(ids)} ids, {len(offsets)} offsets (want one more, from 0 to the number of "
                         f"tokens), {len(tokens)} tokens, {len(mask)} loss_mask entries (want one per token)")
    bad = {"ends before it starts (offsets decrease)": np.flatnonzero(np.diff(offsets) < 0),
           "has a loss_mask value other than 0/1":  # the record holding the first bad entry
               np.searchsorted(offsets, np.flatnonzero((mask != 0) & (mask != 1)), side="right") - 1}
    for why, records in bad.items():
        if records.size:
            k = int(records[0])
            raise ValueError(f"{path}: record {k} (id {str(ids[k])!r}) {why}")
    return [{"id": str(ids[k]), "input_ids": tokens[offsets[k]:offsets[k + 1]].astype(np.int64).tolist(),
             "loss_mask": mask[offsets[k]:offsets[k + 1]].astype(np.int64).tolist()} for k in range(len(ids))]


def load_records(path: str | Path) -> list[dict]:
    """Training records from a JSONL shard directory or a packed `.npz`; a clear error when there are none."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"training data not found: {p}")
    records = load_packed(p) if p.suffix == ".npz" else list(read_shards(p))
    if not records:
        raise ValueError(f"no training records in {p}")
    return records
