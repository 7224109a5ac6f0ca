"""KV cache rollback: rejected positions are forgotten exactly."""

import pytest
import torch
from conftest import tiny_target

from mirror_rt.devices.torch.kv_cache import KVCache, new_cache
from mirror_rt.runtime.backend import CacheFull


def test_rollback_then_refeed_equals_fresh_prefill():
    """After a rejected window is rolled back, re-feeding gives a fresh prefill's logits."""
    model = tiny_target(seed=1)
    prefix, rejected, replacement = torch.arange(2, 12), torch.tensor([40, 41, 42]), torch.tensor([7, 8])
    cache = new_cache(model, 32)
    model(prefix, cache)
    model(rejected, cache)
    cache.rollback(len(prefix))
    after_rollback = model(replacement, cache)
    fresh = model(torch.cat([prefix, replacement]), new_cache(model, 32))[-2:]
    assert torch.allclose(after_rollback, fresh, atol=1e-12)
    assert cache.length == 12


def test_rollback_rejects_growth():
    cache = KVCache(1, 1, 2, 8)
    cache.advance(3)
    with pytest.raises(ValueError):
        cache.rollback(4)


def test_write_past_capacity_raises():
    cache = KVCache(1, 1, 2, 4)
    cache.advance(3)
    with pytest.raises(CacheFull):
        cache.write(0, torch.zeros(1, 2, 2), torch.zeros(1, 2, 2))
