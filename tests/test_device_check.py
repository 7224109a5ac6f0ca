"""`mirror-rt devices --check` on this CPU (no CUDA here: it says so and checks the CPU), and its parts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.evaluation.device_check import first_mismatch, format_check, run_check, top2_margin


@pytest.mark.parametrize("expected,got,index", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1),
                                                ([1, 2, 3], [1, 2], 2), ([], [], None)])
def test_first_mismatch(expected, got, index):
    assert first_mismatch(expected, got) == index


def test_top2_margin_is_the_targets_own_gap():
    model = TorchModel(tiny_target(seed=1))
    prompt, tokens = [5, 6, 7], [8, 9]
    logits = model.forward(prompt + tokens[:1], model.new_cache(16))[-1]
    first, second = torch.topk(logits, 2).values.tolist()
    assert top2_margin(model, prompt, tokens, 1) == pytest.approx(first - second)


@pytest.fixture(scope="module")
def doc():
    return run_check(["tiny"], max_new_tokens=12, log=lambda *a: None)


def test_check_runs_every_pair_found_here(doc):
    """One CPU pair per model without CUDA (fp32 target, int8 draft); with CUDA two more per device and model."""
    cuda = torch.cuda.device_count()
    assert doc["cuda"] == [f"cuda:{i}" for i in range(cuda)] and len(doc["pairs"]) == 1 + 2 * cuda
    cpu = doc["pairs"][0]
    assert cpu["target"] == "cpu" and cpu["precision"] == "fp32 / int8"
    assert cpu["equal"] == {"sd": True, "mirror": True} and cpu["margin"] == {"sd": None, "mirror": None}
    assert all(cpu["tokens_per_s"][m] > 0 for m in ("ar", "sd", "mirror"))
    assert cpu["device_to_host_bytes_per_token"]["sd"] == 0  # a CPU target: nothing crosses a device
    assert "pinned" in cpu["placement"] and len(doc["cross_device"]) == cuda


def test_a_gpu_box_checks_its_gpu_pairs_before_the_cpu_pair(monkeypatch):
    """With CUDA the GPU pairs come first (the CPU pair of the 1.7B preset takes minutes), the table still starts
    with the CPU pair, and each device's fp32 pair is compared with the CPU's."""
    from mirror_rt.evaluation import device_check

    ran, compared = [], []

    def check_pair(model, device, dtype, compile, tokens, log):
        ran.append((model, device, dtype))
        return device_check.PairCheck(model, device, "draft", str(dtype), compile, "placement")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(device_check, "check_pair", check_pair)
    monkeypatch.setattr(device_check, "compare_devices", lambda model, cpu, gpu: compared.append(
        (cpu.target, gpu.target, gpu.precision)) or {})
    doc = run_check(["a", "b"], log=lambda *a: None)
    gpu = [(d, t) for d in ("cuda:0", "cuda:1") for t in (None, "float32")]
    assert ran == [(m, *pair) for m in ("a", "b") for pair in [*gpu, ("cpu", "float32")]]
    assert [(p["model"], p["target"]) for p in doc["pairs"]][:5] == [("a", "cpu")] + [("a", d) for d, _ in gpu]
    assert compared == [("cpu", d, "float32") for _ in "ab" for d in ("cuda:0", "cuda:1")]


def test_check_output_fits_a_screen_and_says_when_there_is_no_cuda(doc):
    text = format_check(doc)
    assert len(text.splitlines()) <= 24 and max(len(line) for line in text.splitlines()) <= 130
    if not doc["cuda"]:
        assert "no CUDA device found" in text.splitlines()[0]


def test_cli_check_exits_zero_and_writes_json(tmp_path, capsys):
    from mirror_rt.cli import main

    out = tmp_path / "check.json"
    assert main(["devices", "--check", "--models", "tiny", "--max-new-tokens", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "placement, run (mirror)" in printed and "tiny" in printed
    assert json.loads(out.read_text())["pairs"][0]["model"] == "tiny"
