"""Training under hard faults (issue 15): a run SIGKILLed at seeded-random instants and at every stage of a checkpoint
write resumes from the last complete checkpoint and replays the uninterrupted run's losses; a damaged checkpoint is
refused by name; corrupt or truncated data shards fail with an error naming the file and the record.

The killed runs are forked children of the test process calling `train(..., resume=True)` (what `blockdraft train
--resume` calls; tests/test_cli.py covers that wiring): a fork costs milliseconds where a fresh interpreter costs
seconds of imports, and SIGKILL gives the child no chance to clean up, exactly as the OOM killer or a lost node would.
"""

import json
import os
import random
import shutil
import signal
import struct
import time
import traceback
import zipfile

import pytest
import torch

from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.target import TargetModel
from blockdraft.train import records as R
from blockdraft.train.checkpoint import FAULT_ENV, latest_checkpoint
from blockdraft.train.config import TrainConfig
from blockdraft.train.records import load_records
from blockdraft.train.trainer import train
from conftest import MASK_ID, VOCAB, tiny_llama

# every place in save_checkpoint where a kill leaves something different on disk, in write order
STAGES = ("draft.safetensors", "optim.pt", "config.json", "state.json", "renamed", "latest")
SAVE_EVERY = 3
TOTAL = 48  # more steps than the kill plan below can use up (<= 3 per stage kill, <= ~6 per random kill)


@pytest.fixture(scope="module")
def tiny():
    return TargetModel(tiny_llama(seed=3, layers=3))


def _records(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"r{i}", "input_ids": torch.randint(0, VOCAB - 2, (24,), generator=g).tolist(),
             "loss_mask": [0] * 6 + [1] * 18} for i in range(n)]


def _cfg(out, **kw) -> TrainConfig:
    base = dict(out_dir=str(out), num_layers=1, block_size=4, num_target_features=2, mask_token_id=MASK_ID,
                anchors=4, lr=3e-3, seqs_per_step=2, steps=TOTAL, save_every=SAVE_EVERY, keep_last=2, log_every=1,
                precision="fp32", seed=0, init="random", draft_vocab_size=0, warmup=1, min_lr_ratio=0.0)
    return TrainConfig(**(base | kw))


def _fork_train(cfg: TrainConfig, target, records, fault: str | None) -> int:
    """Start `train(cfg, resume=True)` in a forked child (with the checkpoint fault hook armed) -> its pid."""
    pid = os.fork()
    if pid == 0:  # the child: one thread, as the reference run; never returns into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            if fault:
                os.environ[FAULT_ENV] = fault
            train(cfg, target=target, records=records, resume=True, progress=False)
            code = 0
        except BaseException:  # noqa: BLE001 - report whatever it is, then leave with a failure status
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _running(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None  # WNOWAIT: leave it to _wait


def _wait(pid: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"training child {pid} still running after {timeout} s")


def _log(out) -> list[dict]:
    path = out / "train_log.jsonl"
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:  # the line a kill tore: trimmed by the next resume
            pass
    return entries


def _step_of(ckpt) -> int:
    return 0 if ckpt is None else int(ckpt.name.split("-")[1])


def test_sigkill_anywhere_resumes_from_last_complete_checkpoint_and_replays_losses(tiny, tmp_path, one_thread):
    recs = _records(6, seed=15)
    ref = train(_cfg(tmp_path / "ref"), target=tiny, records=recs, progress=False)
    assert len(ref["losses"]) == TOTAL
    times = [e["time"] for e in _log(tmp_path / "ref")]
    step_s = (times[-1] - times[0]) / (TOTAL - 1)
    out = tmp_path / "killed"
    cfg = _cfg(out)
    rng = random.Random(15)
    plan = [("stage", s) for s in STAGES] + [("random", None)] * 4
    rng.shuffle(plan)
    for kind, stage in plan + [("finish", None)]:
        start = _step_of(latest_checkpoint(out))
        t0 = time.time()
        pid = _fork_train(cfg, tiny, recs, stage)
        if kind == "random":
            k = rng.randint(1, 4)  # steps logged by this child before the kill, then a seeded fraction of a step
            while len([e for e in _log(out) if e["time"] >= t0]) < k and _running(pid):
                time.sleep(0.002)
            time.sleep(rng.uniform(0, step_s))
            os.kill(pid, signal.SIGKILL)
        status = _wait(pid)
        if kind == "finish":
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        else:
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (kind, stage, status)
        ckpt = latest_checkpoint(out)  # raises if `latest` names a damaged checkpoint
        if kind == "stage":
            nxt = (start // SAVE_EVERY + 1) * SAVE_EVERY  # the save the hook cut
            # cut before `latest` moved: the previous checkpoint, except that a run with no pointer yet resumes from
            # its newest renamed (hence complete) directory
            moved = stage == "latest" or (stage == "renamed" and start == 0)
            assert _step_of(ckpt) == (nxt if moved else start), (stage, start, ckpt)
            torn = out / "checkpoints" / f".tmp-step-{nxt:07d}"
            assert torn.is_dir() == (stage in STAGES[:4]), stage  # the kill really landed mid-write
        if (out / "draft").exists():
            DFlashDraftModel.from_pretrained(out / "draft")  # the exported draft is never half-written
        # this child resumed from the checkpoint it was given and logged the uninterrupted run's losses from there
        mine = [e for e in _log(out) if e["time"] >= t0]
        assert [e["step"] for e in mine] == list(range(start + 1, start + 1 + len(mine))), (start, mine[:2])
        # same ops, inputs and order (fp32, one thread); the tolerance only allows for CPU kernels whose path depends
        # on memory alignment (a fork's allocations differ), as in test_train's resume test
        assert [e["loss"] for e in mine] == pytest.approx(ref["losses"][start:start + len(mine)], rel=1e-6, abs=1e-7)
    final = _log(out)
    assert [e["step"] for e in final] == list(range(1, TOTAL + 1))  # resumes trimmed what they replayed
    assert [e["loss"] for e in final] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
    a, b = (DFlashDraftModel.from_pretrained(d / "draft").state_dict() for d in (tmp_path / "ref", out))
    for name in a:
        torch.testing.assert_close(b[name], a[name])  # fp32 default tolerance, for the same reason as the losses
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-0000045", "step-0000048"]


def test_damaged_checkpoint_is_refused_by_name(tiny, tmp_path, one_thread):
    recs = _records(4, seed=16)
    cfg = _cfg(tmp_path / "run", steps=6, save_every=2, keep_last=3)
    train(cfg, target=tiny, records=recs, progress=False)
    ckpts = tmp_path / "run" / "checkpoints"
    optim = ckpts / "step-0000006" / "optim.pt"
    optim.write_bytes(optim.read_bytes()[:-10])  # torn by something outside the writer (disk, a copy)
    with pytest.raises(ValueError, match=r"step-0000006 is damaged \(optim\.pt not the size"):
        train(cfg, target=tiny, records=recs, progress=False, resume=True)
    # a run written before the `latest` pointer existed resumes from its newest step directory
    shutil.rmtree(ckpts / "step-0000006")
    (ckpts / "latest").unlink()
    assert latest_checkpoint(tmp_path / "run").name == "step-0000004"
    with pytest.raises(FileExistsError):
        train(cfg, target=tiny, records=recs, progress=False)
    assert train(cfg, target=tiny, records=recs, progress=False, resume=True)["steps"] == 6


# ------------------------------------------------------------------------------------------------- damaged data
GOOD = [{"id": f"r{i}", "input_ids": [1, 2, 3 + i], "loss_mask": [0, 1, 1]} for i in range(3)]


def _jsonl(recs) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in recs)


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:-9], r"shard-00001\.jsonl:3: invalid JSON .*truncated"),  # a copy cut short
    (lambda b: b + b"\0" * 40, r"shard-00001\.jsonl:4: invalid JSON .*NUL bytes"),  # crash before data hit the disk
    (lambda b: b.replace(b'"r1"', b'"r\xff"'), r"shard-00001\.jsonl:2: not UTF-8"),  # a flipped bit
    (lambda b: b.replace(b"[0, 1, 1]}\n{\"id\": \"r2\"", b"[0, 1]}\n{\"id\": \"r2\"", 1),
     r"shard-00001\.jsonl:2 \(record 'r1'\): len\(input_ids\)=3 != len\(loss_mask\)=2"),
])
def test_damaged_jsonl_shard_names_file_and_record(tmp_path, damage, match):
    d = tmp_path / "shards"
    d.mkdir()
    (d / R.shard_name(0)).write_bytes(_jsonl(GOOD))
    (d / R.shard_name(1)).write_bytes(damage(_jsonl(GOOD)))
    with pytest.raises(ValueError, match=match):
        load_records(d)
    if b"\xff" in (d / R.shard_name(1)).read_bytes():  # regeneration's resume scan reads shards the same way
        with pytest.raises(ValueError, match=match):
            R.ShardWriter(d, 10)


def _flip_inside(path, member: str) -> None:
    """Flip one byte in the middle of a zip member's compressed data (past its local header)."""
    info = zipfile.ZipFile(path).getinfo(member)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
    pos = info.header_offset + 30 + name_len + extra_len + info.compress_size // 2
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))


def _rewrite(path, **arrays) -> None:
    import numpy as np

    with np.load(path) as z:
        a = {k: z[k] for k in z.files}
    a.update(arrays)
    np.savez_compressed(path, **a)


def test_damaged_packed_npz_names_file_and_record(tmp_path):
    import numpy as np

    g = torch.Generator().manual_seed(17)
    recs = [{"id": f"p{i}", "input_ids": torch.randint(0, 60000, (400,), generator=g).tolist(),
             "loss_mask": [0] * 100 + [1] * 300} for i in range(5)]
    path = tmp_path / "train.npz"

    def fresh():
        R.pack_uint16(recs, path)
        return path

    assert load_records(fresh()) == recs
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut short loses the zip directory
    with pytest.raises(ValueError, match=r"train\.npz: not a readable \.npz, truncated or corrupt"):
        load_records(path)
    _flip_inside(fresh(), "tokens.npy")  # the CRC (or the inflater) catches it
    with pytest.raises(ValueError, match=r"train\.npz: array 'tokens' is truncated or corrupt"):
        load_records(path)
    offsets = np.array([0, 400, 800, 700, 1600, 2000])
    _rewrite(fresh(), offsets=offsets)
    with pytest.raises(ValueError, match=r"train\.npz: record 2 \(id 'p2'\) ends before it starts"):
        load_records(path)
    mask = np.array([r["loss_mask"] for r in recs], dtype=np.uint8).ravel()
    mask[1234] = 7
    _rewrite(fresh(), loss_mask=mask)
    with pytest.raises(ValueError, match=r"train\.npz: record 3 \(id 'p3'\) has a loss_mask value other than 0/1"):
        load_records(path)
    _rewrite(fresh(), ids=np.array(["p0", "p1"]))
    with pytest.raises(ValueError, match=r"train\.npz: 2 ids, 6 offsets"):
        load_records(path)
    with np.load(fresh()) as z:
        np.savez(path, tokens=z["tokens"])
    with pytest.raises(ValueError, match=r"train\.npz: not a packed record file: no array loss_mask, offsets, ids"):
        load_records(path)
