"""GGUF export for llama.cpp (gguf_export.py): written files read back with the `gguf` package. No llama.cpp build
needed; the slow tier (test_llamacpp_slow.py) runs the files in llama.cpp itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from blockdraft.cli import main
from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.draft_config import DFlashConfig
from blockdraft.export.gguf import export_draft_gguf, export_target_gguf, gguf_tensor_name, llamacpp_target_layers
from blockdraft.models.target import TargetModel

from conftest import VOCAB, ToyTokenizer, seeded, tiny_llama, tiny_qwen3

LAYER_TENSORS = {"attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_gate", "ffn_up", "ffn_down"}


def _write_target_gguf(path, n_layers: int, hidden: int, vocab: int = VOCAB, tensors: dict | None = None) -> None:
    """A minimal llama-architecture GGUF: shape metadata and a toy BPE tokenizer (what the draft export copies),
    plus `tensors` {name: (array, raw_dtype or None)}."""
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", n_layers)
    w.add_uint32("llama.embedding_length", hidden)
    w.add_string("general.name", "tiny")
    w.add_uint32("general.file_type", 7)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    w.add_array("tokenizer.ggml.token_type", [3] + [1] * (vocab - 1))
    w.add_array("tokenizer.ggml.merges", ["t 1", "t 2"])
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab - 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    for name, (arr, raw) in (tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def target_files(tmp_path):
    """(HF dir, GGUF) of one tiny 5-layer llama target (untied LM head, so the head rows come from lm_head)."""
    hf = tiny_llama(seed=3)
    d = tmp_path / "target"
    hf.save_pretrained(d)
    gguf = tmp_path / "target.gguf"
    _write_target_gguf(gguf, hf.config.num_hidden_layers, hf.config.hidden_size)
    return hf, d, gguf


def _draft(hf, tmp_path, draft_vocab: int | None, name: str = "draft"):
    target = TargetModel(hf, ToyTokenizer())
    cfg = DFlashConfig.from_target(target.config, num_hidden_layers=2, block_size=6, mask_token_id=VOCAB - 1,
                                   num_target_features=2, draft_vocab_size=draft_vocab)
    with seeded(11):
        draft = DFlashDraftModel(cfg)
    if draft_vocab is not None:
        g = torch.Generator().manual_seed(5)
        draft.set_draft_vocab(torch.randperm(VOCAB, generator=g)[:draft_vocab])
    draft.save_pretrained(tmp_path / name)
    return draft, tmp_path / name


def _tensors(path) -> dict:
    return {t.name: t for t in GGUFReader(str(path)).tensors}


def _fields(path) -> dict:
    return {f.name: f.contents() for f in GGUFReader(str(path)).fields.values() if not f.name.startswith("GGUF.")}


def _as_torch(t) -> torch.Tensor:
    """A read-back GGUF tensor as torch, outermost dimension first (GGUF lists the innermost first)."""
    a = np.array(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def test_reduced_vocab_draft_exports_d2t_head_rows_and_layout(tmp_path, target_files):
    hf, tdir, tgguf = target_files
    draft, ddir = _draft(hf, tmp_path, draft_vocab=23)
    res = export_draft_gguf(ddir, tgguf, tdir, tmp_path / "draft.gguf")
    cfg = draft.config
    assert res.draft_vocab_size == 23 and res.target_layers == [i + 1 for i in cfg.target_layer_ids]

    ts = _tensors(res.path)
    expected = ({"fc.weight", "enc.output_norm.weight", "output_norm.weight", "d2t", "output.weight"}
                | {f"blk.{i}.{n}.weight" for i in range(2) for n in LAYER_TENSORS})
    assert set(ts) == expected and res.tensors == len(expected)
    # d2t: int64 absolute target ids (ours are offsets from the draft row: vLLM's convention)
    d2t = ts["d2t"]
    assert d2t.tensor_type == GGMLQuantizationType.I64
    assert np.array(d2t.data).tolist() == draft.vocab_ids.tolist()
    # the head rows: the target's own LM-head rows at those ids, in bf16, GGUF shape [H, Vd]
    head = ts["output.weight"]
    assert [int(x) for x in head.shape] == [cfg.hidden_size, 23]
    assert torch.equal(_as_torch(head), hf.lm_head.weight[draft.vocab_ids].to(torch.bfloat16))
    # weights: 2-D in bf16, norms f32 holding bf16 values, every one equal to the draft's own tensor
    state = draft.state_dict()
    for name, t in state.items():
        if name == "d2t":
            continue
        got = ts[gguf_tensor_name(name)]
        assert [int(x) for x in got.shape] == list(reversed(t.shape)), name
        want_type = GGMLQuantizationType.BF16 if t.dim() == 2 else GGMLQuantizationType.F32
        assert got.tensor_type == want_type, name
        assert torch.equal(_as_torch(got).float(), t.to(torch.bfloat16).float()), name
    assert [int(x) for x in ts["fc.weight"].shape] == [2 * cfg.hidden_size, cfg.hidden_size]

    f, tf = _fields(res.path), _fields(tgguf)
    assert f["general.architecture"] == "dflash" and f["general.file_type"] == 32
    assert f["dflash.target_layers"] == [i + 1 for i in cfg.target_layer_ids]
    assert (f["dflash.block_count"], f["dflash.block_size"], f["dflash.embedding_length"]) == (2, 6, cfg.hidden_size)
    assert (f["dflash.attention.head_count"], f["dflash.attention.head_count_kv"]) == (cfg.num_attention_heads,
                                                                                     cfg.num_key_value_heads)
    assert f["dflash.attention.key_length"] == f["dflash.attention.value_length"] == cfg.head_dim
    assert f["dflash.feed_forward_length"] == cfg.intermediate_size
    assert f["dflash.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert f["dflash.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert f["tokenizer.ggml.mask_token_id"] == VOCAB - 1
    for k, v in tf.items():  # the target's tokenizer, field for field
        if k.startswith("tokenizer."):
            assert f[k] == v, k


def test_full_vocab_draft_uses_the_targets_head(tmp_path, target_files):
    hf, tdir, tgguf = target_files
    _, ddir = _draft(hf, tmp_path, draft_vocab=None)
    res = export_draft_gguf(ddir, tgguf, tdir, tmp_path / "draft.gguf", outtype="f32")
    ts = _tensors(res.path)
    assert res.draft_vocab_size is None and "d2t" not in ts and "output.weight" not in ts
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in ts.values())
    assert _fields(res.path)["general.file_type"] == 0


def test_layer_ids_are_ours_plus_one():
    # our tap = output of layer i = llama.cpp's captured input of layer i + 1; the last layer's output is n_layer
    assert llamacpp_target_layers([0, 2, 4], 5) == [1, 3, 5]
    with pytest.raises(ValueError, match="outside"):
        llamacpp_target_layers([5], 5)


def test_draft_that_does_not_fit_is_a_clear_error(tmp_path, target_files):
    hf, tdir, tgguf = target_files
    _, qdir = _draft(tiny_qwen3(), tmp_path, draft_vocab=None, name="qwen-draft")  # hidden 40 vs the target's 48
    with pytest.raises(ValueError, match="does not fit"):
        export_draft_gguf(qdir, tgguf, tdir, tmp_path / "x.gguf")
    _, ddir = _draft(hf, tmp_path, draft_vocab=None)
    other = tmp_path / "other.gguf"
    _write_target_gguf(other, n_layers=7, hidden=hf.config.hidden_size)  # HF dir and GGUF disagree
    with pytest.raises(ValueError, match="7 layers"):
        export_draft_gguf(ddir, other, tdir, tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError):
        export_draft_gguf(ddir, tmp_path / "missing.gguf", tdir, tmp_path / "x.gguf")
    cfg = json.loads((ddir / "config.json").read_text())
    cfg["architectures"] = ["Eagle3DraftModel"]
    (ddir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a DFlash draft"):
        export_draft_gguf(ddir, tgguf, tdir, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("x.gguf*"))  # no half-written output left behind


def test_cli_export_needs_a_gguf_target(tmp_path, target_files, capsys):
    hf, tdir, _ = target_files
    _, ddir = _draft(hf, tmp_path, draft_vocab=None)
    rc = main(["export", "--format", "gguf", "--draft", str(ddir), "--target", str(tdir), "--out",
               str(tmp_path / "x.gguf")])
    assert rc == 2 and "llama.cpp runs GGUF targets" in capsys.readouterr().err


def test_target_export_dequantizes_to_the_bf16_weights_our_engine_runs(tmp_path):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 64, generator=g)  # Q8_0 blocks are 32 wide
    norm = torch.randn(64, generator=g).numpy()
    q = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    src = tmp_path / "t.gguf"
    _write_target_gguf(src, 1, 64, tensors={"blk.0.ffn_up.weight": (q, GGMLQuantizationType.Q8_0),
                                            "output_norm.weight": (norm, None)})
    res = export_target_gguf(src, tmp_path / "t-bf16.gguf")
    ts, f = _tensors(res.path), _fields(res.path)
    from gguf.quants import dequantize

    deq = torch.from_numpy(np.array(dequantize(q, GGMLQuantizationType.Q8_0)))
    assert ts["blk.0.ffn_up.weight"].tensor_type == GGMLQuantizationType.BF16
    assert torch.equal(_as_torch(ts["blk.0.ffn_up.weight"]), deq.to(torch.bfloat16))
    assert ts["output_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert torch.equal(_as_torch(ts["output_norm.weight"]), torch.from_numpy(norm).to(torch.bfloat16).float())
    assert f["general.file_type"] == 32 and f["general.architecture"] == "llama"
    assert {k: v for k, v in f.items() if k != "general.file_type"} == \
        {k: v for k, v in _fields(src).items() if k != "general.file_type"}
    with pytest.raises(ValueError, match="overwrite"):
        export_target_gguf(src, src)
