"""The DFlash draft: attention pattern, cached vs full context, public checkpoint layout, compatibility errors."""

import json

import pytest
import torch

from blockdraft.models.draft import DFlashDraftModel, check_compatible
from blockdraft.models.draft_config import DFlashConfig, default_target_layer_ids
from blockdraft.models.target import TargetModel
from conftest import MASK_ID, tiny_draft, tiny_llama, tiny_qwen3


def _inputs(target: TargetModel, draft: DFlashDraftModel, ctx_len=7, q=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = draft.config.num_target_features * target.hidden_size
    feats = torch.randn(1, ctx_len, k, generator=g)
    block = torch.full((1, q), MASK_ID)
    block[0, 0] = 5
    return feats, block


def _run(target, draft, feats, block):
    ctx_len = feats.shape[1]
    ks, vs = draft.context_kv(feats, torch.arange(ctx_len).unsqueeze(0))
    pos = torch.arange(ctx_len, ctx_len + block.shape[1]).unsqueeze(0)
    return draft(target.embed(block), pos, ks, vs)


def test_default_layer_ids_spread_from_1_to_L_minus_3():
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(5, 3) == [0, 2, 4]  # 1..L-3 is too short for 3 distinct layers


def test_context_is_visible_and_block_is_bidirectional(target: TargetModel):
    draft = tiny_draft(target)
    feats, block = _inputs(target, draft)
    base = _run(target, draft, feats, block)
    feats2 = feats.clone()
    feats2[0, 0] += 1.0  # the earliest context position
    assert not torch.allclose(_run(target, draft, feats2, block), base), "context must be visible to the block"
    block2 = block.clone()
    block2[0, -1] = 3  # the LAST block position changes...
    out2 = _run(target, draft, feats, block2)
    assert not torch.allclose(out2[0, 0], base[0, 0]), "...and the FIRST position sees it: no causal mask"


def test_incremental_context_equals_full_context(target: TargetModel):
    """Appending context in pieces (what decoding does) gives the same K/V as projecting it at once."""
    draft = tiny_draft(target)
    feats, _ = _inputs(target, draft, ctx_len=9)
    k_all, v_all = draft.context_kv(feats, torch.arange(9).unsqueeze(0))
    k1, v1 = draft.context_kv(feats[:, :4], torch.arange(4).unsqueeze(0))
    k2, v2 = draft.context_kv(feats[:, 4:], torch.arange(4, 9).unsqueeze(0))
    torch.testing.assert_close(torch.cat([k1, k2], dim=3), k_all)
    torch.testing.assert_close(torch.cat([v1, v2], dim=3), v_all)
    assert k_all.shape == (draft.config.num_hidden_layers, 1, draft.config.num_key_value_heads, 9,
                           draft.config.head_dim)


def test_batched_context_kv_equals_per_layer_projection(target: TargetModel):
    """The one-matmul projection for all layers equals each layer's own k/v projection (naive reference)."""
    from blockdraft.models.draft_layers import apply_rope, rope_cos_sin

    draft = tiny_draft(target, layers=3)
    feats, _ = _inputs(target, draft)
    pos = torch.arange(7).unsqueeze(0)
    ks, vs = draft.context_kv(feats, pos)
    ctx = draft.hidden_norm(draft.fc(feats))
    cfg = draft.config
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, ctx.dtype)
    for i, layer in enumerate(draft.layers):
        a = layer.self_attn
        k = a.k_norm(a.k_proj(ctx).view(1, 7, cfg.num_key_value_heads, cfg.head_dim)).transpose(1, 2)
        v = a.v_proj(ctx).view(1, 7, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        torch.testing.assert_close(ks[i], apply_rope(k, cos, sin))
        torch.testing.assert_close(vs[i], v)


def test_save_load_round_trip_in_public_layout(tmp_path, llama_target):
    draft = tiny_draft(llama_target, layers=2)
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == draft.config.target_layer_ids
    assert cfg["dflash_config"]["mask_token_id"] == MASK_ID
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == llama_target.num_layers
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight",
            "layers.1.post_attention_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names), "embedding and LM head are the target's"
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    feats, block = _inputs(llama_target, draft)
    torch.testing.assert_close(_run(llama_target, loaded, feats, block), _run(llama_target, draft, feats, block))


def test_bf16_save_is_bf16(tmp_path, llama_target):
    tiny_draft(llama_target).save_pretrained(tmp_path)
    assert DFlashDraftModel.from_pretrained(tmp_path).dtype == torch.bfloat16


def test_mismatched_draft_is_a_clear_error(llama_target):
    other = TargetModel(tiny_qwen3())
    draft = tiny_draft(other)
    with pytest.raises(ValueError, match="does not fit"):
        check_compatible(draft.config, llama_target)


def test_config_validation():
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_target(tiny_llama().config, mask_token_id=500)


def test_corrupt_draft_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        DFlashDraftModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_recommended_decode_block_size(tmp_path, llama_target):
    """A draft's config may recommend a decode block size (blockdraft.decode_block_size); it is the proposer's
    default, survives a save/load, and an explicit block size still wins."""
    from blockdraft.decode.proposers.dflash import DFlashProposer

    draft = tiny_draft(llama_target, layers=1)
    assert DFlashProposer(draft, llama_target).block_size == 8  # the trained size
    draft.config.decode_block_size = 4
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert DFlashProposer(loaded, llama_target).block_size == 4
    assert DFlashProposer(loaded, llama_target, block_size=6).block_size == 6


def test_recommended_decode_method(tmp_path, llama_target):
    """`--method auto` decodes with the method a draft's config recommends (blockdraft.decode_method, kept by a
    save/load), else dflash-adaptive, and plainly without a draft; an explicit method wins; a recommendation that
    is not a DFlash method is refused, naming it."""
    from blockdraft.decode.proposers.tree import TreeProposer
    from blockdraft.decode.spec import AUTO, DecodeSpec, build_engine

    draft = tiny_draft(llama_target, layers=1)
    auto = DecodeSpec(method=AUTO)
    assert auto.resolved(llama_target, draft).method == "dflash-adaptive"
    assert auto.resolved(llama_target, None).method == "ar"
    draft.config.decode_method = "dflash-tree"
    draft.save_pretrained(tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["blockdraft"]["decode_method"] == "dflash-tree"
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    engine = build_engine(llama_target, loaded, DecodeSpec(method=AUTO, tree_budget=3))  # fixed budget: no calibration
    assert engine.spec.method == "dflash-tree" and isinstance(engine.proposer, TreeProposer)
    assert DecodeSpec(method="dflash").resolved(llama_target, loaded).method == "dflash"
    for bad in ("pld", "eagle", "nope"):
        loaded.config.decode_method = bad
        with pytest.raises(ValueError, match=f"config.json: decode_method '{bad}' is not a DFlash method"):
            auto.resolved(llama_target, loaded)


def test_extending_taps_or_depth_keeps_the_draft_function(target: TargetModel):
    """A continued draft that gains fused layers (zero fusion columns) or layers (zero output maps) computes what it
    computed before, so a longer run starts where the old one ended; only the new parameters are free."""
    draft = tiny_draft(target)
    with torch.no_grad():  # a trained-looking draft: non-zero everywhere, including what the extension must keep
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    old_ids = draft.config.target_layer_ids
    spare = next(i for i in range(target.num_layers) if i not in old_ids)
    new_ids = [old_ids[1], spare, old_ids[0], old_ids[2]]  # a new tap in the middle and a changed order
    wide = draft.with_target_layers(new_ids)
    assert wide.config.target_layer_ids == new_ids and draft.config.target_layer_ids == old_ids
    feats, block = _inputs(target, draft)
    h = target.hidden_size
    per = feats.view(1, feats.shape[1], len(old_ids), h)
    g = torch.Generator().manual_seed(3)
    wide_feats = torch.stack([per[:, :, old_ids.index(i)] if i in old_ids
                              else torch.randn(per[:, :, 0].shape, generator=g) * 5 for i in new_ids], dim=2)
    base = _run(target, draft, feats, block)
    torch.testing.assert_close(_run(target, wide, wide_feats.flatten(2), block), base)
    deep = draft.with_extra_layers(target, 2)
    assert deep.config.num_hidden_layers == draft.config.num_hidden_layers + 2
    torch.testing.assert_close(_run(target, deep, feats, block), base)
    assert deep.layers[-1].self_attn.q_proj.weight.abs().sum() > 0  # the appended layers are real copies, not zeros
    with pytest.raises(ValueError, match="every old layer"):
        draft.with_target_layers(new_ids[1:2])
    # the next-token input (outside the public layout) likewise starts with zero columns, and survives the others
    nxt = torch.randn(1, feats.shape[1], h, generator=g) * 5
    copy = draft.with_next_token_feature()
    assert copy.config.next_token_feature and not draft.config.next_token_feature
    torch.testing.assert_close(_run(target, copy, torch.cat([feats, nxt], -1), block), base)
    with torch.no_grad():
        copy.fc.weight[:, -h:].normal_(generator=g)
    moved = _run(target, copy, torch.cat([feats, nxt], -1), block)
    assert not torch.allclose(moved, base)
    grown = copy.with_target_layers(new_ids).with_extra_layers(target, 1)
    torch.testing.assert_close(_run(target, grown, torch.cat([wide_feats.flatten(2), nxt], -1), block), moved)


def test_next_token_feature_round_trips_and_stays_out_of_the_public_layout(tmp_path, llama_target):
    """The flag is saved under blockdraft's own config section (the public dflash_config is untouched), loads back
    with the wider fusion, and GGUF export for llama.cpp refuses such a draft with a clear error."""
    from blockdraft.export.gguf import export_draft_gguf

    draft = tiny_draft(llama_target, layers=1).with_next_token_feature(scale=50.0)
    draft.save_pretrained(tmp_path / "d", dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["blockdraft"]["next_token_feature"] is True and "next_token_feature" not in cfg["dflash_config"]
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert loaded.config.next_token_feature and loaded.config.extra.get("next_token_feature") is None
    assert loaded.config.next_token_scale == 50.0 and "next_token_scale" not in loaded.config.extra
    assert loaded.fc.weight.shape[1] == (draft.config.num_target_features + 1) * llama_target.hidden_size
    with pytest.raises(ValueError, match="next token"):
        export_draft_gguf(tmp_path / "d", tmp_path / "none.gguf", tmp_path, tmp_path / "out.gguf")


def test_layer_mix_gives_each_layer_its_own_context(target: TargetModel):
    """With layer_mix, layer l's context keys/values are those of hidden_norm(fc(mix[l] * inputs)) (naive reference:
    the fusion run once per layer on its scaled inputs); all weights 1 is the one-fused-input draft; unequal weights
    give the layers different contexts."""
    from blockdraft.models.draft_layers import apply_rope, rope_cos_sin

    base = tiny_draft(target, layers=3)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    mixed = base.with_layer_mix()
    assert mixed.config.layer_mix and not base.config.layer_mix and mixed.mix.shape == (3, 3)
    feats, block = _inputs(target, base)
    # fp32; the per-input projections sum in another order than one fusion matmul: 1e-5 covers rounding only
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_run(target, mixed, feats, block), _run(target, base, feats, block), **tol)
    with torch.no_grad():
        mixed.mix.copy_(torch.rand(3, 3, generator=torch.Generator().manual_seed(4)) * 2)
    cfg, pos, h = mixed.config, torch.arange(7).unsqueeze(0), target.hidden_size
    ks, vs = mixed.context_kv(feats, pos)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, feats.dtype)
    per = feats.view(1, 7, 3, h)
    for i, layer in enumerate(mixed.layers):
        ctx = mixed.hidden_norm(mixed.fc((per * mixed.mix[i].view(1, 1, 3, 1)).flatten(2)))
        a = layer.self_attn
        k = a.k_norm(a.k_proj(ctx).view(1, 7, cfg.num_key_value_heads, cfg.head_dim)).transpose(1, 2)
        v = a.v_proj(ctx).view(1, 7, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        torch.testing.assert_close(ks[i], apply_rope(k, cos, sin), **tol)
        torch.testing.assert_close(vs[i], v, **tol)
    assert not torch.allclose(_run(target, mixed, feats, block), _run(target, base, feats, block), atol=1e-3)
    # extensions keep the mixed draft's function: more taps (zero columns), more layers (zero outputs), next token
    old_ids = cfg.target_layer_ids
    spare = next(i for i in range(target.num_layers) if i not in old_ids)
    wide = mixed.with_target_layers([spare] + old_ids).with_extra_layers(target, 1)
    wide_feats = torch.cat([torch.randn(1, 7, h, generator=torch.Generator().manual_seed(5)) * 5, feats], -1)
    torch.testing.assert_close(_run(target, wide, wide_feats, block), _run(target, mixed, feats, block), **tol)
    nxt = mixed.with_next_token_feature()
    torch.testing.assert_close(_run(target, nxt, torch.cat([feats, torch.randn(1, 7, h)], -1), block),
                               _run(target, mixed, feats, block), **tol)


def test_layer_mix_round_trips_and_stays_out_of_the_public_layout(tmp_path, llama_target):
    """The flag is saved in blockdraft's own section, the weights in model.safetensors; llama.cpp export refuses."""
    from blockdraft.export.gguf import export_draft_gguf

    draft = tiny_draft(llama_target, layers=2, layer_mix=True)
    with torch.no_grad():
        draft.mix.copy_(torch.tensor([[0.5, 1.0, 2.0], [3.0, 0.25, 1.0]]))
    draft.save_pretrained(tmp_path / "d", dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["blockdraft"]["layer_mix"] is True and "layer_mix" not in cfg["dflash_config"]
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert loaded.config.layer_mix and "layer_mix" not in loaded.config.extra
    torch.testing.assert_close(loaded.mix, draft.mix, rtol=0, atol=0)
    with pytest.raises(ValueError, match="layer_mix"):
        export_draft_gguf(tmp_path / "d", tmp_path / "none.gguf", tmp_path, tmp_path / "out.gguf")
