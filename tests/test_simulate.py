"""The latency model reproduces hand-computed cases."""

import json
import subprocess
import sys

import pytest

from mirror_rt.runtime.simulate import SimConfig, predict


def test_hand_computed_case():
    """N=2, exit 1, 10 ms/layer, flat windows, 2 ms draft forwards, gamma 2, a = 0.5, no side roots.

    tokens/step = (1 - 0.5^3) / 0.5 = 1.75; AR = 20 ms; SD = 2*2 + 20 = 24 ms;
    Mirror = 10 (prefix) + max(10 suffix, 3*2 rollout) + (1 - 0.125) * 4 (fresh) = 23.5 ms.
    """
    cfg = SimConfig(name="hand", target_layers=2, exit_layer=1, target_layer_ms=10, window_growth=0,
                    target_head_ms=0, draft_forward_ms=2, gamma=2, acceptance=0.5, root_coverage=0)
    r = predict(cfg)
    assert r["tokens_per_step"] == 1.75 and r["ar_ms_per_token"] == 20 and r["sd_ms_per_step"] == 24
    assert r["mirror_ms_per_step"] == pytest.approx(23.5)
    assert r["sd_speedup"] == pytest.approx(20 * 1.75 / 24, abs=1e-3)
    assert r["mirror_speedup"] == pytest.approx(35 / 23.5, abs=1e-3)


def test_streams_and_coverage():
    """2 SS streams: a 3-token rollout takes 1 forward; full root coverage: P(hit) = 1 - ... = sum."""
    cfg = SimConfig(name="ss", target_layers=2, exit_layer=1, target_layer_ms=1, window_growth=0,
                    target_head_ms=0, draft_forward_ms=5, gamma=2, acceptance=0.5, root_coverage=1.0, ss_streams=2)
    r = predict(cfg)
    # p_hit = 0.125 + (0.5 + 0.25) = 0.875; rollout = ceil(3/3)*5 = 5; fresh = ceil(2/3)*5 = 5
    assert r["p_hit"] == 0.875
    assert r["mirror_ms_per_step"] == pytest.approx(1 + 5 + 0.125 * 5)


def test_cli_preset_and_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "simulate"], capture_output=True, text=True)
    assert out.returncode == 0 and "mirror" in out.stdout and "qwen3-14b" in out.stdout
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"name": "x"}))
    out = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "simulate", "--config", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "mirror-rt: error: simulate:" in out.stderr
