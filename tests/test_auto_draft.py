"""`--draft auto` placement by the latency model, on fake devices of chosen speeds (hand-computed cases)."""

import pytest

from mirror_rt.devices.auto_draft import DraftCandidate, TargetCosts, choose, pairings, report, table

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
