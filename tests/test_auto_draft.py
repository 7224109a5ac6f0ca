"""`--draft auto`: placement by the latency model on fake devices of chosen speeds (hand-computed cases), and wired
into bundle loading: candidates here, models timed, the latency model's choice, one line."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mirror_rt.devices import auto_draft, bundle_engine
from mirror_rt.devices.auto_draft import (
    DraftCandidate,
    TargetCosts,
    candidates,
    choose,
    pairings,
    pick,
    report,
    table,
)
from mirror_rt.devices.registry import available_devices
from mirror_rt.runtime.backend import Capabilities

# gamma 4: target 20 ms a token, 24 ms a 5-token window split 12 + 12 at the early exit
TARGET = TargetCosts("openvino:GPU", token_ms=20.0, window_ms=24.0, prefix_ms=12.0, suffix_ms=12.0)
CPU = DraftCandidate("ort:cpu", forward_ms=2.0, acceptance=0.8)
NPU = DraftCandidate("openvino:NPU", forward_ms=7.2, acceptance=0.8)  # drafts 3.6x slower per token


def test_the_slow_draft_device_is_not_chosen():
    """tokens/step = (1 - 0.8^5) / 0.2 = 3.3616. AR 50; SD cpu 3.3616 / (8 + 24) = 105.05; Mirror cpu
    12 + max(12, 10) + (1 - 0.32768) * 8 = 29.379 ms -> 114.42; SD npu 28.8 + 24 -> 63.67; Mirror npu
    12 + 36 + 0.67232 * 28.8 = 67.363 ms -> 49.90 (below AR)."""
    best, ranked = choose(TARGET, [NPU, CPU], gamma=4)
    assert (best.mode, best.draft) == ("mirror", "ort:cpu") and best.tokens_per_s == pytest.approx(114.42, abs=0.01)
    speeds = {(p.mode, p.draft): round(p.tokens_per_s, 2) for p in ranked}
    assert speeds == {("ar", None): 50.0, ("sd", "ort:cpu"): 105.05, ("mirror", "ort:cpu"): 114.42,
                      ("sd", "openvino:NPU"): 63.67, ("mirror", "openvino:NPU"): 49.9}
    assert [p.tokens_per_s for p in ranked] == sorted((p.tokens_per_s for p in ranked), reverse=True)


def test_no_speculation_when_every_draft_loses():
    """A 15 ms draft at acceptance 0.3: SD 1.4251 / 84 ms = 16.97, Mirror 9.70 tokens/s; AR's 50 wins."""
    slow = [DraftCandidate("ort:cpu", 15.0, 0.3), DraftCandidate("openvino:NPU", 15.0, 0.3)]
    best, ranked = choose(TARGET, slow, gamma=4)
    assert (best.mode, best.draft, best.tokens_per_s) == ("ar", None, 50.0) and len(ranked) == 5


def test_a_tie_keeps_no_speculation():
    """SD at exactly AR's speed (acceptance 0: one token per 20 ms step) does not displace AR."""
    even = DraftCandidate("ort:cpu", forward_ms=0.0, acceptance=0.0, concurrent=False)
    flat = TargetCosts("ort:cpu", token_ms=20.0, window_ms=20.0)
    best, _ = choose(flat, [even], gamma=4)
    assert best.mode == "ar"


def test_mirror_needs_a_split_target_and_a_concurrent_draft():
    unsplit = TargetCosts("ort:cpu", token_ms=20.0, window_ms=24.0)
    assert {p.mode for p in pairings(unsplit, [CPU], gamma=4)} == {"ar", "sd"}
    shared = DraftCandidate("ort:cpu", forward_ms=2.0, acceptance=0.8, concurrent=False)
    assert {p.mode for p in pairings(TARGET, [shared], gamma=4)} == {"ar", "sd"}


def test_root_coverage_and_rendezvous_enter_mirror_only():
    """Full root coverage: P(hit) = 0.32768 + 0.2 * (1 + 0.8 + 0.64 + 0.512) = 0.91808; plus a 1 ms handoff:
    12 + 1 + 12 + 0.08192 * 8 = 25.655 ms -> 131.03 tokens/s; SD unchanged (105.05)."""
    speeds = {p.mode: p.tokens_per_s for p in pairings(TARGET, [CPU], gamma=4, root_coverage=1.0, rendezvous_ms=1.0)}
    assert speeds["mirror"] == pytest.approx(131.03, abs=0.01) and speeds["sd"] == pytest.approx(105.05, abs=0.01)


def test_report_is_one_line_naming_choice_and_alternatives():
    best, ranked = choose(TARGET, [NPU, CPU], gamma=4)
    line = report(best, ranked, TARGET)
    assert "\n" not in line and line.startswith("draft auto: mirror, draft on ort:cpu 114.4 tokens/s")
    assert "no speculation 50.0 tokens/s" in line and "mirror, draft on openvino:NPU 49.9" in line
    assert len(table(ranked)) == 5 and table(ranked)[0].split()[:2] == ["mirror", "ort:cpu"]


DEVICES = {"onnxruntime": ["cpu", "AzureExecutionProvider", "cuda"], "openvino": ["CPU", "NPU"], "torch": ["cpu"]}


def test_candidates_are_the_devices_that_run_the_draft_format_here():
    assert candidates("onnx-shared", DEVICES) == ["ort:cpu"]  # shared KV: ONNX Runtime on the CPU only
    assert candidates("onnx", DEVICES) == ["ort:cpu", "openvino:CPU", "openvino:NPU"]  # CPUs first
    assert candidates("openvino", DEVICES) == ["openvino:CPU", "openvino:NPU"]


class FakeCache:
    def __init__(self):
        self.length = 0

    def rollback(self, length: int) -> None:
        self.length = length


class FakeModel:
    """A model of chosen speed (ms a forward, plus ms a token) whose greedy pick is `(token + shift) % 7`."""

    vocab_size = 7
    capabilities = Capabilities(split=True)

    def __init__(self, ms: float, per_token_ms: float = 0.0, shift: int = 1):
        self.ms, self.per_token_ms, self.shift = ms, per_token_ms, shift

    def new_cache(self, capacity: int) -> FakeCache:
        return FakeCache()

    def forward(self, tokens, cache) -> np.ndarray:
        time.sleep((self.ms + self.per_token_ms * len(tokens)) / 1e3)
        cache.length += len(tokens)
        return np.eye(self.vocab_size)[(np.asarray(tokens) + self.shift) % self.vocab_size]

    def forward_prefix_only(self, tokens, cache) -> None:  # a split target's first half
        time.sleep((self.ms + self.per_token_ms * len(tokens)) / 2e3)
        cache.length += len(tokens)

    forward_prefix = forward_prefix_only


class Tokens:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 7 for c in text[:24]]


def test_pick_prefers_the_fast_agreeing_draft_and_says_so():
    """Target 20 ms a token; a 2 ms draft that always agrees beats a 30 ms one: Mirror on the fast device."""
    target = FakeModel(20.0, 1.0)
    drafts = {"ort:cpu": FakeModel(30.0), "openvino:NPU": FakeModel(2.0)}
    best, line, rows = pick(target, "ort:cpu", drafts, Tokens(), gamma=4)
    assert (best.mode, best.draft) == ("mirror", "openvino:NPU")
    assert line.startswith("mirror-rt: draft auto: mirror, draft on openvino:NPU") and "acceptance 1.00" in line
    assert len(rows) == 5 and rows[0].startswith("mirror")


@pytest.mark.parametrize("forward_ms,share", [(2.0, 1), (20.0, 6), (200.0, 14)])
def test_mirror_sizes_a_cpu_drafts_cores_from_its_cost(forward_ms, share):
    """Measured pinned on 15 + 1 cores (target prefix 12 ms on 15 = 180 core-ms; the draft's rollout 5 forwards on
    1): its cores are those whose rollout ends with the prefix (devices.placement.draft_share), said in the line."""
    target = TargetCosts("ort:cpu", token_ms=20.0, window_ms=24.0, prefix_ms=12.0, suffix_ms=12.0, cores=15)
    draft = DraftCandidate("openvino:CPU", forward_ms=forward_ms, acceptance=0.9, cores=1)
    mirror = next(p for p in pairings(target, [draft], gamma=4) if p.mode == "mirror")
    assert mirror.draft_cores == share and f"({share} draft core" in mirror.describe()
    assert all(p.draft_cores is None for p in pairings(TARGET, [NPU], gamma=4))  # not on CPU cores: no share


def test_pick_sizes_the_share_from_the_threads_as_placed():
    target = FakeModel(20.0, 1.0)
    best, _, _ = pick(target, "ort:cpu", {"openvino:CPU": FakeModel(0.0)}, Tokens(), gamma=4, threads=(3, 1))
    unpinned, _, _ = pick(target, "ort:cpu", {"openvino:CPU": FakeModel(0.0)}, Tokens(), gamma=4,
                          cpu_concurrent=False, threads=(3, 1))
    assert best.mode == "mirror" and best.draft_cores == 1 and unpinned.draft_cores is None


def test_pick_chooses_no_speculation_when_every_draft_loses():
    """Drafts as slow as the target that never agree: target-only decoding wins."""
    target = FakeModel(4.0)
    drafts = {"ort:cpu": FakeModel(6.0, shift=3), "openvino:NPU": FakeModel(8.0, shift=4)}
    best, line, _ = pick(target, "ort:cpu", drafts, Tokens(), gamma=4)
    assert (best.mode, best.draft) == ("ar", None) and "no speculation" in line


@pytest.fixture(scope="module")
def explicit_bundle(tmp_path_factory):
    """A tiny ONNX bundle with explicit KV: its draft runs on ONNX Runtime and on OpenVINO (two candidates)."""
    devices = available_devices()
    if "cpu" not in devices["onnxruntime"] or "CPU" not in devices["openvino"]:
        pytest.skip("needs onnxruntime and openvino")
    from mirror_rt.exporters.export import export_bundle

    return export_bundle("tiny", tmp_path_factory.mktemp("auto"), kv="explicit", progress=False)


def scripted(speeds: dict):
    """measure_draft returning chosen costs per device (the target is timed for real)."""
    def measure(draft, device, target, ids, concurrent=True, cores=None):
        forward_ms, acceptance = speeds[device]
        return DraftCandidate(device, forward_ms, acceptance, concurrent, cores)
    return measure


@pytest.mark.parametrize("speeds,device,mode", [
    ({"ort:cpu": (0.01, 0.95), "openvino:CPU": (50.0, 0.95)}, "ort:cpu", "mirror"),  # the slow device loses
    ({"ort:cpu": (50.0, 0.95), "openvino:CPU": (0.01, 0.95)}, "openvino:CPU", "mirror"),
    ({"ort:cpu": (50.0, 0.1), "openvino:CPU": (60.0, 0.1)}, "ort:cpu", "ar"),  # both lose: target-only
])
def test_load_bundle_places_the_draft_by_measurement(explicit_bundle, monkeypatch, capsys, speeds, device, mode):
    from mirror_rt import load_bundle
    from mirror_rt.runtime.reference import generate

    monkeypatch.setattr(bundle_engine, "candidates", lambda graph_format: list(speeds))
    monkeypatch.setattr(auto_draft, "measure_draft", scripted(speeds))
    engine = load_bundle(str(explicit_bundle), draft="auto")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("mirror-rt: draft auto: ") and engine.names["draft_device"] == device
    assert engine.default_mode == mode and engine.config_for().mode == mode
    result = engine.generate([5, 6, 7], max_new_tokens=8, chat=False)
    expected = [t for step in generate(engine.target, [5, 6, 7], 8) for t in step]
    assert result.tokens == expected and result.stats["mode"] == mode


def test_one_candidate_times_nothing(explicit_bundle, monkeypatch, capsys):
    monkeypatch.setattr(bundle_engine, "candidates", lambda graph_format: ["ort:cpu"])
    monkeypatch.setattr(auto_draft, "pick", lambda *a, **k: pytest.fail("nothing to choose: nothing timed"))
    engine = bundle_engine.load_bundle(__import__("mirror_rt").EngineConfig.from_flags(bundle=str(explicit_bundle)))
    assert engine.names["draft_device"] == "ort:cpu" and "draft auto" not in capsys.readouterr().err
