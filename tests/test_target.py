"""The target adapter: the hidden-state tap, incremental forward with a cache, rollback."""

import pytest
import torch

from blockdraft.models.target import TargetModel
from conftest import tiny_llama

# The cached forward runs the same fp32 maths as the full one through other kernels (a 5-row then a 7-row matmul
# instead of one 12-row matmul, attention over a cache instead of a causal mask, and per-thread splits that change
# with torch's thread count), so sums are rounded in another order. The rounding error scales with the largest
# values summed, not with each entry: over 60 random inputs at 1 and 2 threads the worst gap was 3.2e-5 of the
# tensor's largest magnitude (LLaMA logits, 2 threads; features reach 250 in these init-0.5 models). A tolerance of
# 1e-4 of that magnitude leaves a 3x margin and still fails on a wrong position, mask or rollback, whose errors are
# of the order of the values themselves.
KERNEL_PATH_REL_TOL = 1e-4


def _assert_close_up_to_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=KERNEL_PATH_REL_TOL * float(expected.abs().max()))


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(seed))


def test_tap_is_output_of_layer_i(target: TargetModel):
    """Feature layer i == HF hidden_states[i + 1] (index 0 there is the embedding output)."""
    ids = _ids(0, 9)
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
    ids = _ids(1, 12)
    target.set_layer_ids([1])
    full = target(ids, None)
    cache = target.new_cache()
    target(ids[:, :5], cache)
    junk = target(_ids(2, 4), cache)  # a rejected block...
    assert cache.length == 9 and junk.logits.shape[1] == 4
    cache.crop(5)  # ...rolled back
    rest = target(ids[:, 5:], cache)
    _assert_close_up_to_rounding(rest.logits, full.logits[:, 5:])
    _assert_close_up_to_rounding(rest.features, full.features[:, 5:])
    with pytest.raises(ValueError):
        cache.crop(13)


def test_last_only_and_no_tap():
    t = TargetModel(tiny_llama())
    ids = _ids(3, 6)
    out = t(ids, t.new_cache(), last_only=True, tap=False)
    assert out.logits.shape == (1, 1, 99) and out.features is None


def test_bad_layer_id_is_a_clear_error():
    t = TargetModel(tiny_llama(layers=3))
    with pytest.raises(ValueError, match="out of range"):
        t.set_layer_ids([3])
