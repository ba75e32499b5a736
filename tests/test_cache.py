import pytest
import torch

from blockdraft.models.cache import KVCache


def _kv(layers, t, fill):
    return torch.full((layers, 1, 2, t, 3), float(fill)), torch.full((layers, 1, 2, t, 3), -float(fill))


def test_append_view_crop_reset_and_grow():
    c = KVCache(num_layers=2, batch=1, num_kv_heads=2, head_dim=3, capacity=4, dtype=torch.float32)
    c.append(*_kv(2, 3, 1))
    c.append(*_kv(2, 4, 2))  # beyond capacity: grows, keeps content
    assert c.length == 7 and c.capacity >= 7
    k, v = c.view(1)
    assert k.shape == (1, 2, 7, 3)
    assert k[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2, 2, 2] and v[0, 0, 0, 0].item() == -1
    c.crop(4)
    c.append(*_kv(2, 1, 9))  # written in place over the cropped tail
    assert c.view(0)[0][0, 0, :, 0].tolist() == [1, 1, 1, 2, 9]
    with pytest.raises(ValueError):
        c.crop(6)
    c.reset()
    assert c.length == 0 and c.view(0)[0].shape[2] == 0


def test_append_rejects_wrong_shape():
    c = KVCache(num_layers=2, batch=1, num_kv_heads=2, head_dim=3, capacity=4, dtype=torch.float32)
    with pytest.raises(AssertionError):
        c.append(torch.zeros(2, 1, 3, 1, 3), torch.zeros(2, 1, 3, 1, 3))
