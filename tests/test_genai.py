"""OpenVINO GenAI folders and the `ov-genai` / `ov-genai-sd` bench runners, on tiny models."""

import json
import sys
from types import SimpleNamespace

import pytest
from conftest import write_hf_folder

from mirror_rt.evaluation.bench_methods import build_runners
from mirror_rt.runtime.config import make_config

F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": 1}
PROMPT = [5, 70, 80, 90, 100, 33, 44]


@pytest.fixture
def genai():
    return pytest.importorskip("openvino_genai")


def _greedy(pipe, ids, max_new_tokens=12, **options):
    import numpy as np
    import openvino as ov
    import openvino_genai

    settings = pipe.get_generation_config()
    settings.max_new_tokens, settings.do_sample = max_new_tokens, False
    for key, value in options.items():
        setattr(settings, key, value)
    prompt = openvino_genai.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)),
                                            ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))
    return list(pipe.generate(prompt, settings).tokens[0])


def _sharp_hf_folder(folder):
    """A tiny HF folder (word-level tokenizer, chat template) whose greedy text is not noise."""
    from safetensors.torch import save_file

    from mirror_rt.models.loading import read_config
    from mirror_rt.models.transformer import random_model

    write_hf_folder(folder, vocab_size=64)
    model = random_model(read_config(folder), seed=0, scale=30.0)
    save_file({k if k == "lm_head.weight" else f"model.{k}": v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_folder_has_optimum_layout(genai, tmp_path):
    """Stateful decoder with GenAI's inputs and outputs, config files beside it."""
    import openvino as ov

    from mirror_rt.exporters.genai import export_genai_folder

    folder = export_genai_folder("tiny", tmp_path / "tiny", log=lambda *_: None)
    model = ov.Core().read_model(folder / "openvino_model.xml")
    assert {p.get_any_name() for p in model.inputs} == {"input_ids", "attention_mask", "position_ids", "beam_idx"}
    assert [p.get_any_name() for p in model.outputs] == ["logits"]
    assert len(model.get_sinks()) == 2 * 4  # key and value state per layer of the tiny preset
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 1


def test_pipeline_greedy_equals_reference(genai, tmp_path):
    """LLMPipeline at f32 on our export generates exactly what our reference does."""
    from mirror_rt.devices.torch.backend import TorchModel
    from mirror_rt.exporters.genai import export_genai_folder
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.runtime.reference import generate

    folder = export_genai_folder("tiny", tmp_path / "tiny", log=lambda *_: None)
    pipe = genai.LLMPipeline(str(folder), "CPU", **F32)
    expected = [t for chunk in generate(TorchModel(load_checkpoint("tiny").model), PROMPT, 12) for t in chunk]
    assert _greedy(pipe, PROMPT) == expected


def test_sd_runner_matches_plain_runner(genai, tmp_path, monkeypatch):
    """ov-genai-sd (int8 draft) gives ov-genai's greedy text; folders are cached and reused."""
    from mirror_rt.models.tokenizer import HFTokenizer

    monkeypatch.setenv("MIRROR_RT_CACHE", str(tmp_path / "cache"))
    folder = _sharp_hf_folder(tmp_path / "hf")
    engine = SimpleNamespace(tokenizer=HFTokenizer(folder))
    runners = build_runners(["ov-genai", "ov-genai-sd"], engine, str(folder), log=lambda *_: None, isolated=False)
    assert [r.name for r in runners] == ["ov-genai", "ov-genai-sd"]
    assert len(list((tmp_path / "cache" / "genai").iterdir())) == 2  # fp32 target, int8 draft
    config = make_config(max_new_tokens=10, gamma=3)
    messages = [{"role": "user", "content": "w5 w9 w17 w33"}]
    plain, sd = (r.answer(messages, config) for r in runners)
    assert sd[0] == plain[0] and sd[1] == plain[1] > 0
    assert sd[4]["inference_precision"] and "num_accepted_tokens" in sd[4]


def test_missing_package_skips_with_one_line(monkeypatch):
    """Without openvino_genai the methods are skipped with a message, not a crash."""
    monkeypatch.setitem(sys.modules, "openvino_genai", None)
    lines = []
    runners = build_runners(["ov-genai", "ov-genai-sd"], SimpleNamespace(tokenizer=None), "tiny", log=lines.append,
                            isolated=False)
    assert runners == [] and len(lines) == 2 and all("skipping ov-genai" in line for line in lines)


def test_sd_skips_a_model_without_tokenizer(genai, tmp_path, monkeypatch):
    """A preset has no tokenizer, which GenAI's speculative pipeline requires: one line, no crash."""
    monkeypatch.setenv("MIRROR_RT_CACHE", str(tmp_path / "cache"))
    lines = []
    assert build_runners(["ov-genai-sd"], SimpleNamespace(tokenizer=None), "tiny", log=lines.append,
                         isolated=False) == []
    assert "needs a tokenizer" in lines[-1]


def test_f32_runner_asks_for_exact_precision_and_equals_our_reference(genai, tmp_path, monkeypatch):
    """ov-genai-f32 names f32 compute and KV (the precision of our fp32 rows) and generates our greedy text."""
    from mirror_rt.devices.torch.backend import TorchModel
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.models.tokenizer import ByteTokenizer
    from mirror_rt.runtime.reference import generate

    monkeypatch.setenv("MIRROR_RT_CACHE", str(tmp_path / "cache"))
    tokenizer = ByteTokenizer(258)
    (runner,) = build_runners(["ov-genai-f32"], SimpleNamespace(tokenizer=tokenizer), "tiny", log=lambda *_: None,
                              isolated=False)
    assert runner.precision == "fp32" and runner.target_only
    assert runner.label == "openvino genai; fp32 target weights, f32 compute, f32 KV"
    text, new_tokens, *_ = runner.answer([{"role": "user", "content": "hello"}], make_config(max_new_tokens=8))
    expected = [t for chunk in generate(TorchModel(load_checkpoint("tiny").model), tokenizer.encode("hello"), 8)
                for t in chunk]
    assert new_tokens == 8 and text == tokenizer.decode(expected)
