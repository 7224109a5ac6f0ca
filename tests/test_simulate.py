"""The latency model reproduces hand-computed cases."""

import json
import subprocess
import sys

import pytest

from mirror_rt.evaluation.simulate import SimConfig, predict


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


HAND = dict(name="hand", target_layers=2, exit_layer=1, target_layer_ms=10, window_growth=0, target_head_ms=0,
            draft_forward_ms=2, gamma=2, acceptance=0.5, root_coverage=0)


@pytest.mark.parametrize("patch, says", [
    ({"ss_streams": -1}, "ss_streams must be in 0..64"), ({"gamma": 10**9}, "gamma must be in 1..64"),
    ({"gamma": 2.5}, "gamma must be an integer"), ({"gamma": "4"}, "gamma must be an integer"),
    ({"target_layer_ms": -1}, "target_layer_ms must be a finite number >= 0"),
    ({"window_growth": float("nan")}, "window_growth must be a finite number"),
    ({"target_layer_ms": 0}, "cannot both be 0"),
    ({"target_layers": 0}, "target_layers must be in 2..10000"),  # it said 'exit_layer must be in 1..-1'
    ({"target_layers": 100000}, "target_layers must be in 2..10000"),  # 0.0 tokens/s at a 3.77x speedup
    ({"target_layer_ms": 1e308}, "target_layer_ms must be at most 1e\\+06"),  # inf ms, NaN speedups, JSON NaN
    ({"name": None}, "name must be a string"),  # it printed 'None: gamma 7'
    ({"acceptance": 1.5}, r"acceptance must be in \[0, 1\), got 1.5"),  # one message for two fields
    ({"root_coverage": 2}, r"root_coverage must be in \[0, 1\], got 2"),
    ({"branches_batched": "no"}, "branches_batched must be true or false"),  # it counted as true
])
def test_impossible_settings_are_refused_in_one_line(patch, says):
    """Negative costs printed negative speeds, a huge gamma hung, 0 costs divided by zero."""
    with pytest.raises(ValueError, match=says):
        SimConfig(**(HAND | patch))


def test_cli_preset_and_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "simulate"], capture_output=True, text=True)
    assert out.returncode == 0 and "mirror" in out.stdout and "qwen3-14b" in out.stdout
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"name": "x"}))
    out = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "simulate", "--config", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "mirror-rt: error: simulate:" in out.stderr
    assert "fields missing target_layers, exit_layer" in out.stderr  # not SimConfig.__init__()'s TypeError
    bad.write_text("[1]")
    out = subprocess.run([sys.executable, "-m", "mirror_rt.cli", "simulate", "--config", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "a JSON object of SimConfig's fields is needed, got list" in out.stderr


def test_mirror_stats_latency_model_hand_computed():
    """Per step: prefix 10, suffix 20, rollout 40, wait 6 (of which fresh 4), 1 miss in 4 verdicts.

    §5 form: 10 + (6 - 4)/2 + max(20, 40)/... with 2 steps: prefix 5, suffix 10, rollout 20 per step,
    rendezvous (6 - 4) / 2 = 1, P(miss) = 1/4, T_fresh = 4 / 1 -> 5 + 1 + 20 + 1 = 27 ms;
    pipelined: 1 + max(5 + 10, 20) + 1 = 22 ms.
    """
    from mirror_rt.runtime.metrics import Metrics
    from mirror_rt.runtime.mirror.draft_row import DraftStats
    from mirror_rt.runtime.mirror.stats import TargetCounters, mirror_summary

    m = Metrics()
    m.record_step(2, 2)
    m.record_step(2, 1)
    m.stage_seconds = {"target_prefix": 0.010, "target_suffix": 0.020, "target_wait": 0.006}
    d = DraftStats(main_hits=3, misses=1, rollout_s=0.040, fresh_s=0.004, forwards=7)
    out = mirror_summary(m, d, TargetCounters(corrections=1, exit_steps=2))
    assert out["predicted_step_ms"] == pytest.approx(27.0)
    assert out["predicted_step_ms_pipelined"] == pytest.approx(22.0)
    assert out["reuse_hit_rate"] == 0.75 and out["mean_window"] == 2.0
    assert out["measured_step_ms"] == pytest.approx(18.0)  # wait 3 + prefix 5 + suffix 10 per step
    # a batched step records its verify whole (runtime.batch.verify): the model's target time and the measured step
    m.stage_seconds = {"target_verify": 0.030, "target_wait": 0.006}
    out = mirror_summary(m, d, TargetCounters(corrections=1, exit_steps=2))
    assert out["measured_step_ms"] == pytest.approx(18.0)
    assert out["predicted_step_ms"] == out["predicted_step_ms_pipelined"] == pytest.approx(22.0)
