"""Every target/draft backend pair the registry can form on this CPU: works (sd and mirror equal ar) or is
refused in one line.

Bundles of the tiny preset in every format (torch, ONNX with explicit KV, ONNX with shared KV,
OpenVINO); each bundle's target is paired with each bundle's draft (`load_bundle(draft_bundle=...)`),
each on every CPU backend that runs its format. The drafts are the target's own copies, so a pair of one
backend may start the draft from the target's KV (its pool row takes the target's); a pair of two backends must
not try (it crashed: `ORTModel.adopt(KVCache)`).
"""

from __future__ import annotations

import warnings

import pytest

from mirror_rt import load_bundle
from mirror_rt.devices.registry import DeviceError, available_devices
from mirror_rt.exporters.export import export_bundle
from mirror_rt.runtime.engine import GenerationError

HAVE = available_devices()
# (bundle, device) per role; onnx bundles run on ONNX Runtime and (explicit KV only) on OpenVINO
SIDES = [("torch", "torch:cpu")]
if HAVE["onnxruntime"]:
    SIDES += [("onnx", "ort:cpu"), ("onnx-shared", "ort:cpu")]
if HAVE["openvino"]:
    SIDES += [("openvino", "openvino:CPU"), ("onnx", "openvino:CPU")]
PAIRS = [(t, d) for t in SIDES for d in SIDES]
PROMPT = "w5 w17 w42 w9"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: export_bundle("tiny", root / name, fmt=name.split("-")[0], progress=False,
                                    kv="shared" if name.endswith("-shared") else "explicit")
                for name in {name for name, _ in SIDES}}


@pytest.mark.parametrize("target,draft", PAIRS, ids=[f"{t[0]}@{t[1]}+{d[0]}@{d[1]}" for t, d in PAIRS])
def test_pair_works_or_is_refused_in_one_line(bundles, target, draft):
    """sd and mirror over the pair give ar's greedy tokens; a pair that cannot run says why in one line."""
    try:
        engine = load_bundle(str(bundles[target[0]]), target=target[1], draft=draft[1],
                             draft_bundle=str(bundles[draft[0]]), strict_devices=True, threads=1, verify=False)
    except (DeviceError, GenerationError) as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    if target[1].split(":")[0] != draft[1].split(":")[0]:
        assert not engine.draft.capabilities.reads_target_rows  # KV lives in another backend's caches
    ar = engine.generate(PROMPT, mode="ar", max_new_tokens=16, chat=False)
    for mode in ("sd", "mirror"):
        got = engine.generate(PROMPT, mode=mode, max_new_tokens=16, gamma=3, chat=False)
        assert got.tokens == ar.tokens, mode
        assert not got.stats["events"], got.stats["events"]  # no fault, no fallback to target-only


def test_mixed_pair_used_to_crash_in_adopt(bundles):
    """The torch target with the ONNX Runtime draft of the same model: the draft never takes the target's KV (it
    lives in another backend's caches), it reads the text itself, and speculation gives ar's tokens."""
    if not HAVE["onnxruntime"]:
        pytest.skip("onnxruntime not installed")
    engine = load_bundle(str(bundles["torch"]), draft_bundle=str(bundles["onnx-shared"]), draft="ort:cpu",
                         strict_devices=True, threads=1, verify=False)
    assert not engine.draft.capabilities.reads_target_rows and not engine.draft.can_adopt(engine.target)
    ar = engine.generate(PROMPT, mode="ar", max_new_tokens=16, chat=False)
    for mode in ("sd", "mirror"):
        assert engine.generate(PROMPT, mode=mode, max_new_tokens=16, gamma=3, chat=False).tokens == ar.tokens
