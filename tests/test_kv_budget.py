"""The KV budget an operator can predict: a fixed default (never the memory free at start-up), the prefix cache's
share of it capped, and the usage gauge counting what is held (rows reserved and cached blocks)."""

import pytest
from conftest import perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.runtime.batch import decoder as batch
from mirror_rt.runtime.batch.decoder import BatchConfig, BatchDecoder
from mirror_rt.runtime.batch.kv_rows import BLOCK_SIZE, blocks_for
from mirror_rt.runtime.batch.sequence import Sequence
from mirror_rt.runtime.config import GenerationConfig


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(seed=3)
    return TorchSplitTarget(target), TorchModel(perturbed_copy(target, noise=0.3, seed=4))


def per_position(decoder: BatchDecoder) -> int:
    return sum(p.bytes_per_position for p in (decoder.target_pool, decoder.draft_pool))


def test_the_default_budget_is_every_row_at_full_length_or_the_default_gb(pair, monkeypatch):
    """Tiny rows fit the default whole; with a default smaller than the rows, the default is the budget. Neither
    reads the memory free now (the same command got 8.5, 7.3, 4.1, 2.7 GB from 40% of it)."""
    target, draft = pair
    whole = BatchDecoder(target, draft, BatchConfig(max_num_seqs=3))
    assert whole.budget.total == blocks_for(3 * whole.capacity)
    monkeypatch.setattr(batch, "_available_memory", lambda: 1, raising=False)  # what 40% of free memory read
    again = BatchDecoder(target, draft, BatchConfig(max_num_seqs=3))
    assert again.budget.total == whole.budget.total
    small = 20 * per_position(whole) * BLOCK_SIZE / 2**30  # 20 blocks' worth, fewer than the rows take
    monkeypatch.setattr(batch, "DEFAULT_KV_GB", small)
    capped = BatchDecoder(target, draft, BatchConfig(max_num_seqs=3))
    assert capped.budget.total == 20 and capped.budget_bytes() == 20 * BLOCK_SIZE * per_position(whole)
    assert "default: " in capped.describe() and f"{capped.budget.total} blocks of 16" in capped.describe()


def test_the_prefix_cache_keeps_at_most_its_share(pair):
    """A quarter of the budget: after many distinct prompts the cache holds no more than that, and says its bytes."""
    target, draft = pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2, prefix_cache_share=0.25))
    assert decoder.cache.max_blocks == int(0.25 * decoder.budget.total)
    assert decoder.cache.block_bytes == decoder.target_pool.bytes_per_position * BLOCK_SIZE
    config = GenerationConfig(max_new_tokens=4, mode="ar")
    for i in range(12):  # distinct 40-token prompts: 2 full blocks each kept after it
        decoder.add(Sequence(f"s{i}", [(i * 7 + j) % 90 + 3 for j in range(40)], config, budget=4))
        while not decoder.idle:
            decoder.step()
    assert len(decoder.cache) == decoder.cache.max_blocks < 24
    assert decoder.cache.bytes == len(decoder.cache) * decoder.cache.block_bytes > 0
    said = decoder.describe()
    assert f"prefix cache up to {decoder.cache.max_blocks} of those blocks (25%; the target's KV only: " in said
    # what it says is true: binary units (as --kv-cache-gb counts them), the cache's bytes the target's KV of its
    # blocks (it said "up to 1023.8 MB (50% of the budget)" of a 4 GB budget: half of the target's share, in MiB)
    assert f"KV budget {decoder.budget_bytes() / 2**20:.1f} MiB ({decoder.budget.total} blocks" in said, said
    assert f"the target's KV only: {decoder.cache.max_blocks * decoder.cache.block_bytes / 2**20:.1f} MiB)" in said
    assert " GB" not in said and " MB" not in said
    # idle, the usage gauge counts the cached blocks (it read 0.0 while the cache held ~4.9 GB)
    assert decoder.kv_usage() == pytest.approx(len(decoder.cache) / decoder.budget.total)


def test_usage_counts_reserved_rows_and_cached_blocks(pair):
    target, draft = pair
    decoder = BatchDecoder(target, draft, BatchConfig(max_num_seqs=2, prefix_cache=False))
    assert decoder.kv_usage() == 0
    config = GenerationConfig(max_new_tokens=30, mode="ar")
    seq = Sequence("s", [5] * 20, config, budget=30)
    decoder.add(seq)
    decoder.step()
    assert decoder.kv_usage() == pytest.approx(decoder.blocks_needed(seq) / decoder.budget.total)
    while not decoder.idle:
        decoder.step()
    assert decoder.kv_usage() == 0


@pytest.mark.parametrize("share", [0, -0.1, 1.5, "half"])
def test_a_share_outside_0_to_1_is_refused(share):
    with pytest.raises(ValueError, match="--prefix-cache-share must be a number in"):
        BatchConfig(prefix_cache_share=share)
