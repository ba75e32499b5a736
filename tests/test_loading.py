"""Packaged targets split over several packages: the parts joined once into one GGUF, missing parts and corrupt joins
refused with the command that fixes them."""

import importlib
import sys

import pytest

from blockdraft.loading import PartedGGUF, joined_gguf


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
