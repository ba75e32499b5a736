"""The saved draft is what vLLM and SGLang read for a DFlash draft (field and weight names looked up in their
DFlash loaders): a Qwen3-typed config with `dflash_config.{target_layer_ids, mask_token_id}`, and per-layer weights
named like Qwen3's (`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`, the two
layernorms) plus `fc`, `hidden_norm`, `norm`; no embedding and no LM head (both come from the target)."""

import json

import torch
from safetensors import safe_open

from blockdraft.models.draft import DFlashDraftModel
from blockdraft.models.draft_config import DFlashConfig
from conftest import tiny_draft

LAYER_WEIGHTS = {
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}


def test_config_fields_and_weight_names(tmp_path, llama_target):
    draft = tiny_draft(llama_target, layers=3)
    draft.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings", "hidden_act", "vocab_size",
                "rope_parameters", "block_size", "num_target_layers"):
        assert key in cfg, key
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["rope_parameters"]["rope_theta"] == draft.config.rope_theta
    assert cfg["dflash_config"]["target_layer_ids"] == draft.config.target_layer_ids
    assert cfg["dflash_config"]["mask_token_id"] == draft.config.mask_token_id
    assert cfg.get("attention_bias") is False  # engines add biases when this is true

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{w}" for i in range(3) for w in LAYER_WEIGHTS}
    assert set(shapes) == expected
    h, k = draft.config.hidden_size, draft.config.num_target_features
    assert shapes["fc.weight"] == (h, k * h)
    kv = draft.config.num_key_value_heads * draft.config.head_dim
    assert shapes["layers.0.self_attn.k_proj.weight"] == (kv, h)
    assert shapes["layers.0.self_attn.k_norm.weight"] == (draft.config.head_dim,)


def test_config_parses_as_a_transformers_qwen3_config(tmp_path, llama_target):
    from transformers import AutoConfig

    tiny_draft(llama_target).save_pretrained(tmp_path)
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Qwen3Config"
    assert hf.dflash_config["target_layer_ids"] == [0, 2, 4]  # too shallow for 1..L-3: all 5 layers


def test_public_layout_config_loads_here(tmp_path):
    """A config written the way public DFlash drafts are (block size and layer ids inside dflash_config only,
    rope_theta only in rope_parameters) loads into our model."""
    public = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "intermediate_size": 37,
        "vocab_size": 99, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        "max_position_embeddings": 4096, "num_target_layers": 5,
        "dflash_config": {"block_size": 8, "target_layer_ids": [0, 2, 4], "mask_token_id": 98},
    }
    cfg = DFlashConfig.from_hf_dict(public)
    assert (cfg.block_size, cfg.rope_theta, cfg.target_layer_ids) == (8, 1e6, [0, 2, 4])
    DFlashDraftModel(cfg).save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.config.mask_token_id == 98 and loaded.block_size == 8
