"""GGUF export for llama.cpp: a blockdraft DFlash draft as llama.cpp's `dflash` architecture (what
`--spec-type draft-dflash -md DRAFT.gguf` loads), and a bf16 copy of a GGUF target.

Why our own writer and not llama.cpp's `convert_hf_to_gguf.py`: its DFlash class has no reduced-vocabulary path
(`Can not map tensor 'model.d2t'` on our default draft), and it needs the llama.cpp source tree. The layout below is
the one that converter writes (checked tensor by tensor against its output for a full-vocabulary draft) plus the two
tensors llama.cpp's DFlash loader reads for a reduced vocabulary (`src/models/dflash.cpp`): `d2t`, int64 *absolute*
target ids of the draft rows, and `output.weight`, the draft-vocabulary head rows. Both come from the draft (d2t)
and the target's own LM head, so llama.cpp drafts among exactly the tokens, with exactly the head rows, that our
engine uses.

Layer ids: llama.cpp captures the *input* of target layer j (`llama_set_embeddings_layer_inp`), while our tap (and
the public DFlash checkpoints) take the *output* of layer i, HF `hidden_states[i + 1]`. The output of layer i is the
input of layer i + 1, so the GGUF's `dflash.target_layers` are our ids + 1 (the converter adds the same 1); llama.cpp
sizes its capture table n_layer + 1, so the last layer's output (j = n_layer) is valid too.

Tokenizer: copied field by field from the target's GGUF, the file llama.cpp runs as `-m`, so the draft's vocabulary
passes llama.cpp's draft/target compatibility check by construction (the converter writes the same fields from the
HF tokenizer). The bf16 target copy dequantizes the target GGUF's own tensors: the same numbers transformers
dequantizes into the safetensors copy our engine loads (loading.materialize), rounded to bf16 as our engine does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import cache_dir
from ..models.loading import materialize, resolve_target
from ..models.copy_gate import GATE_WEIGHTS_NAME
from ..models.selector import SELECTOR_WEIGHTS_NAME
from ..models.draft import check_compatible
from ..models.draft_files import read_draft_dir
from ..models.draft_config import DFlashConfig
from ..models.hf_config import text_config

log = logging.getLogger(__name__)

ARCH = "dflash"
FILE_TYPE = {"bf16": 32, "f32": 0}  # llama.cpp's LLAMA_FTYPE_MOSTLY_BF16 / ALL_F32 (general.file_type)

# our draft tensor names -> llama.cpp's (gguf-py constants.py, MODEL_ARCH.DFLASH; the converter's mapping)
_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(name: str) -> str:
    """Our draft state-dict name -> the DFlash GGUF tensor name (KeyError for a name llama.cpp has no slot for)."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"blk.{parts[1]}.{_LAYER[parts[2]]}"
    raise KeyError(name)


def llamacpp_target_layers(layer_ids, num_target_layers: int) -> list[int]:
    """Our tapped layer ids (layer *outputs*, HF hidden_states[i + 1]) -> llama.cpp's (layer *inputs*): i + 1."""
    out = [int(i) + 1 for i in layer_ids]
    bad = [i for i in layer_ids if not 0 <= int(i) < num_target_layers]
    if bad:
        raise ValueError(f"target layer ids {bad} outside the target's {num_target_layers} layers")
    return out


@dataclass(frozen=True)
class ExportResult:
    path: Path
    tensors: int
    draft_vocab_size: int | None  # None: the full vocabulary (no d2t, the target's head at run time)
    target_layers: list[int] | None  # llama.cpp's ids (ours + 1); None for a target export


# ------------------------------------------------------------------------------------------------ GGUF helpers
def _reader(path: str | Path):
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    try:
        return GGUFReader(str(p))
    except (ValueError, OSError) as e:
        raise ValueError(f"{p} is not a readable GGUF file: {e}") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _copy_fields(reader, writer, keep) -> None:
    """Copy the metadata fields whose name passes `keep` with their exact GGUF value types."""
    from gguf import GGUFValueType

    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or not keep(f.name):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    """[...] float tensor -> its bf16 (round to nearest even, torch's cast) bit patterns as uint16."""
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _add_float(writer, name: str, t: torch.Tensor, outtype: str) -> None:
    """2-D weights in `outtype`; 1-D (norms) as f32 like llama.cpp's converter, but holding the bf16-rounded values
    when outtype is bf16, so that llama.cpp computes with exactly the weights our bf16 engine uses."""
    from gguf import GGMLQuantizationType

    if outtype == "bf16":
        if t.dim() == 1:
            writer.add_tensor(name, t.detach().to(torch.bfloat16).float().numpy())
        else:
            writer.add_tensor(name, _bf16_bits(t), raw_dtype=GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, t.detach().float().contiguous().numpy())


def _write_atomic(w, tmp: Path, out: Path) -> int:
    """Write the GGUF to `tmp`, then rename it onto `out` (a failed export never leaves a partial file) -> the
    number of tensors written."""
    n = len(w.tensors[0])
    try:
        _write(w)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def _write(writer) -> None:
    """Header, metadata and tensors to a temporary file, then renamed: an interrupted export leaves no stub."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _new_writer(out: Path, arch: str):
    from gguf import GGUFWriter

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    return GGUFWriter(str(tmp), arch), tmp


# ------------------------------------------------------------------------------------------------------ drafts
def _target_head_rows(target_dir: Path, rows: torch.Tensor) -> torch.Tensor:
    """[Vd] target ids -> [Vd, H] rows of the target's LM head (its tied embedding when it has no lm_head), read
    from the target's safetensors without building the model."""
    from safetensors import safe_open

    cfg = json.loads((target_dir / "config.json").read_text())
    names = ["lm_head.weight"] + (["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", True) else [])
    files = sorted(target_dir.glob("*.safetensors"))
    for name in names:
        for f in files:
            with safe_open(str(f), "pt") as st:
                if name in st.keys():
                    return st.get_slice(name)[:][rows]
    raise ValueError(f"{target_dir}: no {' / '.join(names)} in its safetensors: cannot build the draft-vocabulary "
                     f"head rows")


def _check_fits(cfg, target_cfg: dict, reader, gguf_path: Path) -> None:
    from types import SimpleNamespace

    tc = text_config(target_cfg)
    check_compatible(cfg, SimpleNamespace(hidden_size=int(tc["hidden_size"]), vocab_size=int(tc["vocab_size"]),
                                          num_layers=int(tc["num_hidden_layers"])))
    arch = _field(reader, "general.architecture")
    n_embd, n_layer = _field(reader, f"{arch}.embedding_length"), _field(reader, f"{arch}.block_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else None
    problems = []
    if n_embd != cfg.hidden_size:
        problems.append(f"embedding length {n_embd} != draft hidden size {cfg.hidden_size}")
    if n_layer != cfg.num_target_layers:
        problems.append(f"{n_layer} layers, the draft was trained on a {cfg.num_target_layers}-layer target")
    if n_vocab != cfg.vocab_size:
        problems.append(f"{n_vocab} tokenizer tokens != draft vocab size {cfg.vocab_size}")
    if problems:
        raise ValueError(f"draft does not fit the target GGUF {gguf_path.name}: " + "; ".join(problems))


def export_draft_gguf(draft_dir: str | Path, target_gguf: str | Path, target_dir: str | Path, out: str | Path,
                      outtype: str = "bf16") -> ExportResult:
    """Write a DFlash draft directory as a llama.cpp DFlash GGUF.

    draft_dir: our draft (config.json + model.safetensors); target_gguf: the target GGUF llama.cpp will run (its
    tokenizer fields are copied); target_dir: the same target as an HF directory (config.json + safetensors; the
    head rows of a reduced-vocabulary draft are read from it); outtype: 'bf16' (what our engine runs) or 'f32'."""
    if outtype not in FILE_TYPE:
        raise ValueError(f"outtype must be one of {sorted(FILE_TYPE)}, got {outtype!r}")
    draft_dir, target_dir, target_gguf, out = Path(draft_dir), Path(target_dir), Path(target_gguf), Path(out)
    d, state = read_draft_dir(draft_dir)
    if "DFlashDraftModel" not in (d.get("architectures") or []):
        raise ValueError(f"{draft_dir} is not a DFlash draft (architectures {d.get('architectures')}); only DFlash "
                         f"drafts export to llama.cpp's draft-dflash")
    cfg = DFlashConfig.from_hf_dict(d)
    if cfg.next_token_feature:
        raise ValueError(f"{draft_dir} reads the next token's embedding (next_token_feature), an input outside the "
                         "public DFlash layout that llama.cpp's draft-dflash does not compute")
    if cfg.layer_mix:
        raise ValueError(f"{draft_dir} gives each draft layer its own mix of the fused inputs (layer_mix), which "
                         "llama.cpp's draft-dflash does not compute (it feeds every layer one fused input)")
    if cfg.copy_gate:  # the layout part is complete without it: llama.cpp drafts with the plain head
        log.warning("%s has a copy gate (%s): blockdraft's own extension, which llama.cpp does not compute; the "
                    "exported draft proposes without it (fewer accepted tokens where prompt lookup would copy)",
                    draft_dir, GATE_WEIGHTS_NAME)
    if cfg.selector_rank:  # likewise: llama.cpp takes the draft's own best column at each row
        log.warning("%s has a chain selector (%s): blockdraft's own extension, which llama.cpp does not compute; "
                    "the exported draft proposes each row's own best token", draft_dir, SELECTOR_WEIGHTS_NAME)
    if cfg.hidden_act != "silu":
        raise ValueError(f"llama.cpp's DFlash graph runs silu (or gelu) MLPs; this draft has {cfg.hidden_act!r}")
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"target directory {target_dir} has no config.json")
    reader = _reader(target_gguf)
    _check_fits(cfg, json.loads((target_dir / "config.json").read_text()), reader, target_gguf)
    layers = llamacpp_target_layers(cfg.target_layer_ids, cfg.num_target_layers)

    w, tmp = _new_writer(out, ARCH)
    w.add_string("general.type", "model")
    w.add_string("general.name", draft_dir.resolve().name)
    w.add_uint32(f"{ARCH}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{ARCH}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{ARCH}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{ARCH}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{ARCH}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{ARCH}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{ARCH}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{ARCH}.attention.value_length", cfg.head_dim)
    w.add_uint32("general.file_type", FILE_TYPE[outtype])
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    from gguf import GGUFValueType

    w.add_key_value(f"{ARCH}.target_layers", layers, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.add_uint32("general.quantization_version", 2)
    _copy_fields(reader, w, lambda k: k.startswith("tokenizer.") and k != "tokenizer.ggml.mask_token_id")
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)

    vocab = None
    for name, t in state.items():
        if name == "d2t":
            vocab = torch.arange(t.numel(), dtype=torch.long) + t.long()  # ours is offset-coded (vLLM's convention)
            continue
        try:
            gname = gguf_tensor_name(name)
        except KeyError:
            raise ValueError(f"{draft_dir}: tensor {name!r} has no place in llama.cpp's DFlash layout") from None
        _add_float(w, gname, t, outtype)
    if cfg.draft_vocab_size is not None:
        if vocab is None:
            raise ValueError(f"{draft_dir}: draft_vocab_size {cfg.draft_vocab_size} but no d2t tensor")
        if vocab.unique().numel() != vocab.numel() or int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size:
            raise ValueError(f"{draft_dir}: d2t does not map to {vocab.numel()} distinct ids below {cfg.vocab_size}")
        w.add_tensor("d2t", vocab.numpy().astype(np.int64))
        _add_float(w, "output.weight", _target_head_rows(target_dir, vocab), outtype)
    return ExportResult(out, _write_atomic(w, tmp, out), cfg.draft_vocab_size, layers)


# ----------------------------------------------------------------------------------------------------- targets
def export_target_gguf(target_gguf: str | Path, out: str | Path, outtype: str = "bf16") -> ExportResult:
    """Rewrite a (quantized) GGUF target with every tensor dequantized to `outtype` (norms: f32 holding the
    bf16-rounded values, see `_add_float`); metadata copied, general.file_type updated."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if outtype not in FILE_TYPE:
        raise ValueError(f"outtype must be one of {sorted(FILE_TYPE)}, got {outtype!r}")
    target_gguf, out = Path(target_gguf), Path(out)
    if target_gguf.resolve() == out.resolve():
        raise ValueError("the output would overwrite the source GGUF")
    reader = _reader(target_gguf)
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ValueError(f"{target_gguf} has no general.architecture")
    w, tmp = _new_writer(out, arch)
    _copy_fields(reader, w, lambda k: k not in ("general.architecture", "general.file_type"))
    w.add_uint32("general.file_type", FILE_TYPE[outtype])
    for t in reader.tensors:
        if t.tensor_type in (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
                             GGMLQuantizationType.I64):
            w.add_tensor(t.name, np.array(t.data))
            continue
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists dims innermost first; numpy wants outermost first
        vals = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # a writable copy
        _add_float(w, t.name, vals.reshape(shape), outtype)
    return ExportResult(out, _write_atomic(w, tmp, out), None, None)


# ---------------------------------------------------------------------------------- what the CLI and bench call
def target_files(target: str | None) -> tuple[Path, Path]:
    """-> (the target's GGUF file, its HF directory), resolving `--target` as the rest of blockdraft does; a target
    without a GGUF file gets a clear error (llama.cpp runs GGUF targets only)."""
    src = resolve_target(target)
    if src.gguf_file is None:
        raise ValueError(f"target {src.path!r} is not a GGUF file: llama.cpp runs GGUF targets. Convert it first "
                         f"(llama.cpp's convert_hf_to_gguf.py DIR --outfile T.gguf) and pass --target T.gguf")
    return Path(src.path) / src.gguf_file, Path(materialize(src))


def export_gguf(out: str | Path, draft: str | Path | None = None, target: str | None = None,
                outtype: str = "bf16") -> ExportResult:
    """`blockdraft export --format gguf`: the draft at `draft` for `target`, or (draft None) the target itself."""
    gguf, target_dir = target_files(target)
    if draft is None:
        return export_target_gguf(gguf, out, outtype)
    return export_draft_gguf(draft, gguf, target_dir, out, outtype)


def _stamp(paths) -> str:
    """A short key that changes when any of the files changes (path, size, mtime)."""
    h = hashlib.sha1()
    for p in paths:
        st = Path(p).stat()
        h.update(f"{Path(p).resolve()}|{st.st_size}|{int(st.st_mtime)}".encode())
    return h.hexdigest()[:12]


def cached_gguf(draft: str | Path | None, target: str | None, outtype: str = "bf16") -> Path:
    """The GGUF export of `draft` (or of the target, draft None) under the cache dir, written on first use and
    reused while the source files are unchanged: what the bench's llama.cpp methods run."""
    gguf, _ = target_files(target)
    srcs = [gguf] + ([Path(draft) / "config.json", Path(draft) / "model.safetensors"] if draft is not None else [])
    stem = f"{gguf.stem}-{outtype}" if draft is None else f"{Path(draft).resolve().name}-{outtype}"
    out = cache_dir() / "gguf" / f"{stem}-{_stamp(srcs)}.gguf"
    if not out.is_file():
        export_gguf(out, draft, target, outtype)
    return out
