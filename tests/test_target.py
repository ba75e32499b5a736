"""The target adapter: the hidden-state tap, incremental forward with a cache, rollback."""

import pytest
import torch

from blockdraft.target import TargetModel
from conftest import tiny_llama


def test_tap_is_output_of_layer_i(target: TargetModel):
    """Feature layer i == HF hidden_states[i + 1] (index 0 there is the embedding output)."""
    ids = torch.randint(0, 90, (1, 9))
    layer_ids = [0, 2, target.num_layers - 1]
    target.set_layer_ids(layer_ids)
    out = target(ids, None)
    hf = target.hf(ids, output_hidden_states=True)
    h = target.hidden_size
    for k, i in enumerate(layer_ids[:-1]):  # HF's last entry has the final norm applied; checked separately
        torch.testing.assert_close(out.features[..., k * h:(k + 1) * h], hf.hidden_states[i + 1])
    assert out.features.shape == (1, 9, 3 * h)
    torch.testing.assert_close(out.logits, hf.logits)


def test_incremental_forward_and_crop_match_full_forward(target: TargetModel):
    ids = torch.randint(0, 90, (1, 12))
    target.set_layer_ids([1])
    full = target(ids, None)
    cache = target.new_cache()
    target(ids[:, :5], cache)
    junk = target(torch.randint(0, 90, (1, 4)), cache)  # a rejected block...
    assert cache.length == 9 and junk.logits.shape[1] == 4
    cache.crop(5)  # ...rolled back
    rest = target(ids[:, 5:], cache)
    torch.testing.assert_close(rest.logits, full.logits[:, 5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest.features, full.features[:, 5:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        cache.crop(13)


def test_last_only_and_no_tap():
    t = TargetModel(tiny_llama())
    ids = torch.randint(0, 90, (1, 6))
    out = t(ids, t.new_cache(), last_only=True, tap=False)
    assert out.logits.shape == (1, 1, 99) and out.features is None


def test_bad_layer_id_is_a_clear_error():
    t = TargetModel(tiny_llama(layers=3))
    with pytest.raises(ValueError, match="out of range"):
        t.set_layer_ids([3])
