"""The decoder matches transformers' implementation and is window-size invariant."""

import pytest
import torch
import transformers
from conftest import tiny_target

from mirror_rt.devices.torch.kv_cache import new_cache
from mirror_rt.models.config import ModelConfig
from mirror_rt.models.transformer import Transformer


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("mistral", {}), ("qwen2", {}),
                                        ("qwen3", {"head_dim": 16})])
def test_matches_transformers(arch, extra):
    """Logits equal HF's within 1e-6 (HF computes RoPE in float32, hence not 1e-12)."""
    hf_config = transformers.AutoConfig.for_model(
        model_type=arch, vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ours = Transformer(ModelConfig.from_hf(hf_config.to_dict())).double()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()})
    tokens = torch.randint(0, 97, (12,))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    cache = new_cache(ours, 32)
    got = torch.cat([ours(tokens[:5], cache), ours(tokens[5:6], cache), ours(tokens[6:], cache)])
    assert (got - expected).abs().max().item() < 1e-6


def test_window_equals_one_at_a_time():
    """A window forward gives the same logits as feeding its tokens one by one."""
    model = tiny_target(seed=3)
    tokens = torch.randint(0, 97, (9,))
    window = model(tokens, new_cache(model, 16))
    cache = new_cache(model, 16)
    single = torch.cat([model(tokens[i:i + 1], cache) for i in range(9)])
    assert torch.allclose(window, single, atol=1e-10)


def test_unsupported_architecture_named():
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 10})
