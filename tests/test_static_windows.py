"""Static-shape windows (`devices.torch.static`) and `--compile` on the CPU (inductor).

Windows run padded to 1 or 8 rows (longer ones eagerly, unpadded) with KV written at device-side positions
and attention over every slot under a mask; padding rows are never committed. Greedy output must equal the eager
reference token for token (tiny float64 models: their rounding differences are far below any margin).
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch
import torch._inductor.config
from conftest import decode, flat, perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.devices.torch.static import VERIFY_ROWS, WINDOW_SIZES, window_size
from mirror_rt.models.config import ModelConfig
from mirror_rt.models.transformer import MAX_PAD, random_model
from mirror_rt.runtime.backend import CacheFull
from mirror_rt.runtime.reference import generate

PROMPT = [5, 17, 42, 9, 80, 33, 61]


@pytest.fixture(autouse=True)
def own_inductor_cache(tmp_path_factory, monkeypatch):
    """Inductor compiles into this run's own folder and without its precompiled headers (kept in a fixed folder of
    /tmp, outside TORCHINDUCTOR_CACHE_DIR): what another run left in /tmp cannot fail these tests. The header is a
    compile-time cache only; the kernels are the same."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor"))
    with torch._inductor.config.patch(cpp_cache_precompile_headers=False):
        yield


@pytest.mark.parametrize("rows,size", [(1, 1), (2, 8), (5, 8), (8, 8), (9, None), (300, None)])
def test_window_sizes(rows, size):
    assert window_size(rows) == size and (size is None or size in WINDOW_SIZES)


def test_static_logits_equal_eager_and_padding_is_never_committed():
    """A 3-row window (padded to 8) gives the eager logits; the cache advances by 3; the padded slots are
    overwritten by the next windows, whose logits are again the eager ones."""
    target = tiny_target(seed=1)
    eager, static = TorchModel(target), TorchModel(target, static=True)
    eager_cache, static_cache = eager.new_cache(64), static.new_cache(64)
    np.testing.assert_allclose(static.forward(PROMPT, static_cache), eager.forward(PROMPT, eager_cache), atol=1e-9)
    for window in ([7, 8, 9], [11], [12, 13, 14, 15, 16], list(range(30, 42))):  # 12 rows: eager, unpadded
        np.testing.assert_allclose(static.forward(window, static_cache), eager.forward(window, eager_cache),
                                   atol=1e-9)
        assert static_cache.length == eager_cache.length
    static_cache.rollback(len(PROMPT) + 2)
    eager_cache.rollback(len(PROMPT) + 2)
    np.testing.assert_allclose(static.forward([20, 21], static_cache), eager.forward([20, 21], eager_cache),
                               atol=1e-9)
    assert static.static.sizes_run == {(0, 4, 1), (0, 4, VERIFY_ROWS)}  # two shapes: 1 and gamma_max + 1


@pytest.mark.parametrize("seed", range(3))
def test_static_greedy_equals_reference_in_every_mode(seed):
    target = tiny_target(seed=seed)
    draft = perturbed_copy(target, noise=0.4, seed=seed + 50)
    expected = flat(generate(TorchModel(target), PROMPT, 40))
    split = TorchSplitTarget(target, kappa=4, static=True)
    assert flat(generate(split, PROMPT, 40)) == expected
    assert decode(split, TorchModel(draft), PROMPT, max_new_tokens=40, gamma=4).tokens == expected
    assert decode(split, TorchModel(draft), PROMPT, mode="mirror", max_new_tokens=40, gamma=5).tokens == expected


def test_static_cache_refuses_to_pass_capacity():
    model = TorchModel(tiny_target(seed=0), static=True)
    cache = model.new_cache(8)
    model.forward(PROMPT, cache)
    with pytest.raises(CacheFull):
        model.forward([1, 2], cache)


def test_storages_are_pooled_and_reused():
    """A dropped cache's storage serves the next request (a CUDA graph keeps its address); live caches differ."""
    model = TorchModel(tiny_target(seed=0), static=True)
    first = model.new_cache(40)
    second = model.new_cache(100)  # same slot bucket, both alive: two storages
    assert first.keys.data_ptr() != second.keys.data_ptr()
    pointer = first.keys.data_ptr()
    del first
    gc.collect()
    assert model.new_cache(50).keys.data_ptr() == pointer


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_a_request_attends_over_the_slots_it_may_fill_not_the_context(mode):
    """The batched decoder gives a static target's sequence a cache as long as its prompt, output budget and window
    in flight, not the model's whole context: attention reads every slot of a static window (on the H200, 57% of a
    step's GPU time went to the 8192 slots of a 40-token request)."""
    config = dataclasses.replace(ModelConfig.from_name("tiny"), vocab_size=97, max_seq_len=4096)
    target = random_model(config, seed=3, scale=30.0)
    split = TorchSplitTarget(target, kappa=4, static=True)
    expected = flat(generate(TorchModel(target), PROMPT, 20))
    assert decode(split, TorchModel(perturbed_copy(target, noise=0.4, seed=9)), PROMPT, mode=mode,
                  max_new_tokens=20, gamma=4).tokens == expected
    gc.collect()
    slots = set(split.static.free)  # the storages the request's caches used, back in the pool
    assert slots and max(slots) <= 256 + MAX_PAD, slots  # 7 + 20 + the window room fit the smallest storage


@pytest.mark.slow
def test_compiled_greedy_equals_eager_reference():
    """`--compile` (inductor on the CPU): ar, sd and mirror over the compiled split target give the eager tokens;
    the windows compile once at warm-up, and a request over a larger cache storage compiles nothing more
    (the slot count is symbolic)."""
    config = dataclasses.replace(ModelConfig.from_name("tiny"), vocab_size=97, max_seq_len=1024)
    target = random_model(config, seed=2, scale=30.0)
    draft = perturbed_copy(target, noise=0.4, seed=9)
    long_prompt = PROMPT * 40  # 280 tokens: a 512-slot storage, not the warm-up's 256
    expected = {len(p): flat(generate(TorchModel(target), p, 30)) for p in (PROMPT, long_prompt)}
    compiled = TorchSplitTarget(target, kappa=4, compile=True)
    compiled.warm_up()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for prompt in (PROMPT, long_prompt):
        assert flat(generate(compiled, prompt, 30)) == expected[len(prompt)]
        assert decode(compiled, TorchModel(draft), prompt, max_new_tokens=30, gamma=4).tokens == expected[len(prompt)]
        got = decode(compiled, TorchModel(draft), prompt, mode="mirror", max_new_tokens=30, gamma=4).tokens
        assert got == expected[len(prompt)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no compile after warm-up


@pytest.mark.slow
def test_compiled_bf16_target_reads_its_fp32_head_and_follows_the_eager_target():
    """A bf16 target under `--compile`: its windows read the fp32 LM head copy (made eagerly before the call,
    never inside the compiled code) and greedy decoding gives the eager bf16 target's tokens (a model with wide
    logit margins: bf16 rounding of a fused kernel cannot flip its choices)."""
    config = dataclasses.replace(ModelConfig.from_name("tiny"), vocab_size=97, max_seq_len=512)
    target = random_model(config, seed=2, scale=30.0).to(torch.bfloat16)
    draft = perturbed_copy(target, noise=0.4, seed=9)
    compiled = TorchSplitTarget(target, kappa=4, compile=True)
    compiled.warm_up()  # first: no eager call has made the copy yet
    assert target.head32 is not None and target.head32.dtype == torch.float32
    expected = flat(generate(TorchModel(target), PROMPT, 24))
    assert flat(generate(compiled, PROMPT, 24)) == expected
    assert decode(compiled, TorchModel(draft), PROMPT, mode="mirror", max_new_tokens=24, gamma=4).tokens == expected
