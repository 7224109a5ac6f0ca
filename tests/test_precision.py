"""Precision as a setting: bf16 / fp16 targets, RMSNorm and RoPE tables in fp32, the int8 draft of any target.

"Lossless" means identical to the target at its own precision: `ar` runs the same bf16 target, and sd and
mirror must equal it token for token (every decode step runs at one window shape, so no window length
rounds a position's logits another way).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target

from mirror_rt.devices import torch_engine
from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.evaluation.device_check import first_mismatch
from mirror_rt.models.quantize import int8_copy
from mirror_rt.models.transformer import RMSNorm, rope_inv_freq, rope_tables


def test_rmsnorm_normalizes_in_fp32():
    """fp16 would overflow x^2 at SmolLM-sized activations; bf16 equals the fp32 computation rounded once."""
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(3, 64) * 400  # x^2 ~ 1.6e5 > fp16 max 65504
    expected = norm(x)
    half = norm.to(torch.float16)(x.half())
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), expected, atol=2e-2, rtol=2e-3)
    bf16 = norm.to(torch.bfloat16)
    assert torch.equal(bf16(x.bfloat16()), bf16.weight * norm.float()._normalize(x.bfloat16().float()).bfloat16())


def test_rope_tables_stay_exact_through_casts():
    """inv_freq stays fp32 in a bf16 model; the tables are derived at each dtype, never cast from another."""
    model = tiny_target(seed=0).to(torch.bfloat16)
    assert model.inv_freq.dtype == torch.float32
    inv = rope_inv_freq(model.config).float()
    positions = torch.arange(model.rope_cos.shape[0])
    assert torch.equal(model.inv_freq, inv)
    assert torch.equal(model.rope_cos, rope_tables(inv, positions, torch.bfloat16)[0])
    back = model.to(torch.float32)
    assert torch.equal(back.rope_sin, rope_tables(inv, positions, torch.float32)[1])  # not bf16 values cast up


def test_rope_tables_grow_on_demand():
    model = tiny_target(seed=0)
    model.rope_cos = model.rope_cos[:8]
    model.ensure_rope(100)
    assert model.rope_cos.shape[0] >= 100


def test_default_dtype_by_device(monkeypatch):
    assert torch_engine.default_dtype("cpu") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert torch_engine.default_dtype("cuda:0") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert torch_engine.default_dtype("cuda") == "float16"


def test_int8_draft_of_a_bf16_target():
    """The default draft works whatever the target dtype (quantized from fp32 copies of its weights)."""
    target = tiny_target(seed=0).to(torch.bfloat16)
    draft = int8_copy(target)
    assert target.embed_tokens.weight.dtype == torch.bfloat16  # the original is untouched
    assert draft.embed_tokens.weight.dtype == torch.float32
    assert draft(torch.tensor([5, 6]), new_cache(draft, 4)).shape == (2, target.config.vocab_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_copy_is_torchs_dynamic_quantization(dtype):
    """The copy is what torch.ao.quantization.quantize_dynamic makes of the target's Linear layers: the same int8
    weights, scales, biases and logits, built without its full-size placeholder weights."""
    import copy
    import warnings

    from torch.ao.nn.quantized.dynamic import Linear

    target = tiny_target(seed=0).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.ao.quantization.quantize_dynamic(copy.deepcopy(target).float(), {torch.nn.Linear},
                                                          dtype=torch.qint8)
    draft = int8_copy(target)
    layers = {name: m for name, m in expected.named_modules() if isinstance(m, Linear)}
    assert layers and layers.keys() == {name for name, m in draft.named_modules() if isinstance(m, Linear)}
    for name, layer in layers.items():
        ours = draft.get_submodule(name)
        assert repr(ours) == repr(layer) and torch.equal(ours.weight().int_repr(), layer.weight().int_repr())
        assert (ours.weight().q_scale(), ours.weight().q_zero_point()) == (layer.weight().q_scale(),
                                                                          layer.weight().q_zero_point())
        assert (ours.bias() is None) == (layer.bias() is None)
        assert ours.bias() is None or torch.equal(ours.bias(), layer.bias())
    ids = torch.tensor([5, 6, 7])
    assert torch.equal(draft(ids, new_cache(draft, 4)), expected(ids, new_cache(expected, 4)))


def test_int8_draft_of_an_fp32_target_keeps_its_weights_when_the_target_moves():
    """An fp32 CPU target's copy shares its storage (no second fp32 model in memory), never its Parameters:
    converting or changing the target afterwards leaves the draft as it was."""
    target = tiny_target(seed=0).float()
    draft = int8_copy(target)
    assert draft.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()  # shared, not copied
    ids = torch.tensor([5, 6, 7])
    before = draft(ids, new_cache(draft, 4))
    target.to(torch.bfloat16)
    target.norm.weight.data = torch.zeros_like(target.norm.weight)
    assert isinstance(target.layers[0].mlp.gate_proj, torch.nn.Linear)  # the target's own layers stay float
    assert draft.embed_tokens.weight.dtype == torch.float32 and bool((draft.norm.weight == 1).all())
    assert torch.equal(draft(ids, new_cache(draft, 4)), before)


@pytest.mark.parametrize("dtype", ["bf16", "float16"])
def test_low_precision_target_is_lossless_at_its_precision(dtype):
    """Every decode step of a bf16 / fp16 target runs at one window shape, so sd and mirror give exactly
    the tokens of `ar` on the same target, near-ties of its logits included."""
    engine = torch_engine.load_torch(EngineConfig.from_flags(model="tiny", dtype=dtype), log=lambda *a: None)
    assert engine.names["target_precision"] == {"bf16": "bf16", "float16": "fp16"}[dtype]
    assert engine.names["draft_precision"] == "int8"
    assert engine.target.static.sizes == (8,)  # one-token steps padded like verify windows
    for prompt in ("hello world", "the quick brown fox", "abc", "zz top 42", "a b c d e f g"):
        expected = engine.generate(prompt, mode="ar", max_new_tokens=60, chat=False, ignore_eos=True).tokens
        for mode in ("sd", "mirror"):
            for gamma in (2, 4, 7):
                got = engine.generate(prompt, mode=mode, gamma=gamma, max_new_tokens=60, chat=False,
                                      ignore_eos=True).tokens
                assert first_mismatch(expected, got) is None, (prompt, mode, gamma)


def test_low_precision_logits_come_from_an_fp32_copy_of_the_current_head():
    """bf16 weights, fp32 logits (no ties from 8-bit mantissas); the copy follows in-place weight changes."""
    model = tiny_target(seed=0).to(torch.bfloat16)
    with torch.inference_mode():
        logits = model(torch.tensor([5, 6]), new_cache(model, 4))
    assert logits.dtype == torch.float32 and model.head32.dtype == torch.float32
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # exact in bf16
    with torch.inference_mode():
        again = model(torch.tensor([5, 6]), new_cache(model, 4))
    torch.testing.assert_close(again, 2 * logits)
    assert tiny_target(seed=0).head32 is None  # fp32 / fp64 models keep no copy
