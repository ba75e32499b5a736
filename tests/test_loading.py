"""Packaged targets split over several packages: the parts joined once into one GGUF, missing parts and corrupt joins
refused with the command that fixes them."""

import importlib
import sys

import pytest

from blockdraft.models.loading import PartedGGUF, joined_gguf


def _packages(root, name: str, parts: list[bytes]) -> PartedGGUF:
    """Installable-looking packages {name}{i} with data/part{i:02d}.bin under root (on sys.path)."""
    for i, data in enumerate(parts, 1):
        pkg = root / f"{name}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    return PartedGGUF("toy", f"{name}.gguf", tuple(f"{name}{i}" for i in range(1, len(parts) + 1)), "make toy")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "site").mkdir()
    yield tmp_path / "site"
    importlib.invalidate_caches()


def test_parts_are_joined_once_in_order(site):
    parts = [b"GGUF" + bytes(range(7)), bytes([9] * 5), b"end"]
    t = _packages(site, "toyparts", parts)
    importlib.invalidate_caches()
    out = joined_gguf(t)
    assert out.read_bytes() == b"".join(parts)
    mtime = out.stat().st_mtime_ns
    assert joined_gguf(t) == out and out.stat().st_mtime_ns == mtime  # not joined again
    assert not out.with_name(out.name + ".tmp").exists()


def test_a_missing_part_names_its_package_and_the_fix(site):
    t = _packages(site, "toymissing", [b"GGUF", b"x"])
    t = PartedGGUF(t.name, t.file, t.packages + ("toymissing3",), t.install)
    importlib.invalidate_caches()
    with pytest.raises(FileNotFoundError, match=r"toymissing3 \(part 3 of 3\): make toy"):
        joined_gguf(t)


def test_a_join_that_is_not_a_gguf_is_refused(site):
    t = _packages(site, "toybad", [b"NOPE", b"x"])
    importlib.invalidate_caches()
    with pytest.raises(ValueError, match="not a GGUF"):
        joined_gguf(t)
    assert not list((site.parent / "cache" / "gguf").glob("*"))  # nothing half-written left behind
    for m in [m for m in sys.modules if m.startswith("toy")]:
        del sys.modules[m]


def _join_in_child(args):
    from pathlib import Path

    from blockdraft.models.loading import join_parts

    parts, out = args
    return str(join_parts([Path(p) for p in parts], Path(out)))


def test_two_processes_joining_at_once_both_get_a_correct_file(tmp_path):
    """Two processes start cold on an empty cache at the same moment: both return the joined file, whose sha256
    equals a clean concatenation's (no truncated or interleaved write is ever published), and the hash recorded
    beside it says so."""
    import hashlib
    import multiprocessing as mp

    from blockdraft.atomic import sha256_file

    rng = __import__("random").Random(3)
    parts = []
    for i in range(3):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes((b"GGUF" if i == 0 else b"") + bytes(rng.getrandbits(8) for _ in range(3_000_000)))
        parts.append(str(p))
    want = hashlib.sha256(b"".join(open(p, "rb").read() for p in parts)).hexdigest()
    out = tmp_path / "cache" / "joined.gguf"
    with mp.get_context("spawn").Pool(2) as pool:
        got = pool.map(_join_in_child, [(parts, str(out))] * 2)
    assert got == [str(out)] * 2
    assert sha256_file(out) == want
    assert (tmp_path / "cache" / "joined.gguf.sha256").read_text().strip() == want
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]


def test_a_joined_file_altered_in_place_is_joined_again(tmp_path):
    """Reuse checks content, not only size: a same-size file whose bytes changed is replaced by a fresh join."""
    from blockdraft.atomic import sha256_file
    from blockdraft.models.loading import join_parts

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"GGUF" + bytes(range(200)))
    b.write_bytes(bytes(100))
    out = join_parts([a, b], tmp_path / "j.gguf")
    good = sha256_file(out)
    data = bytearray(out.read_bytes())
    data[50] ^= 0xFF
    out.write_bytes(bytes(data))
    assert join_parts([a, b], tmp_path / "j.gguf") == out
    assert sha256_file(out) == good
