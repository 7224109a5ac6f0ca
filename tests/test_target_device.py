"""`--target cuda` without a bundle, honest fallbacks, ONNX Runtime on CUDA, and placement by device.

No GPU here: CUDA's presence is simulated where the choice depends on it (torch.cuda.device_count), and
the engine assembly is checked up to the call that would move weights to the GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mirror_rt.devices import engines, registry, torch_engine
from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.placement import draft_share, is_accelerator, plan
from mirror_rt.devices.registry import DeviceError, DeviceFallbackWarning, DeviceSpec, resolve

CPU_ONLY = {"torch": ["cpu"], "openvino": ["CPU"], "onnxruntime": ["cpu"]}
WITH_NPU = {"torch": ["cpu"], "openvino": ["CPU", "NPU"], "onnxruntime": ["cpu"]}


def _fallback_message(*args, **kwargs) -> tuple[DeviceSpec, str]:
    with pytest.warns(DeviceFallbackWarning) as record:
        spec = resolve(*args, **kwargs)
    assert len(record) == 1 and "\n" not in str(record[0].message)
    return spec, str(record[0].message)


def test_cuda_fallback_names_what_is_missing_for_the_bundle():
    """An ONNX bundle on `cuda`: torch cannot run it and ONNX Runtime on CUDA is refused; never 'not available'."""
    spec, message = _fallback_message("cuda", graph_format="onnx-shared", devices=CPU_ONLY)
    assert spec == DeviceSpec("onnxruntime", "cpu")
    assert "torch cannot run onnx graphs" in message and "ONNX Runtime on CUDA is not supported" in message
    assert "not available" not in message


def test_cuda_fallback_for_torch_graphs_says_torch_sees_no_cuda():
    spec, message = _fallback_message("cuda:1", graph_format="torch", devices=CPU_ONLY)
    assert spec == DeviceSpec("torch", "cpu") and "torch sees no CUDA device 1" in message


def test_missing_provider_is_named():
    spec, message = _fallback_message("ort:qnn", graph_format="onnx", devices=CPU_ONLY)
    assert spec.backend == "onnxruntime" and "onnxruntime has no QNN provider (it has cpu)" in message


def test_ort_cuda_is_refused_in_one_line_even_with_the_provider():
    """ONNX Runtime on CUDA is refused (fp32 graphs), pointing at torch."""
    with pytest.raises(DeviceError, match="run the target in torch") as info:
        resolve("ort:cuda", graph_format="onnx", devices={**CPU_ONLY, "onnxruntime": ["cpu", "cuda"]})
    assert "\n" not in str(info.value)


def test_shared_kv_bundle_falls_back_from_an_npu_instead_of_raising():
    """The default (shared-KV) bundle with --draft npu on a machine with an NPU: ort:cpu, with the reason."""
    spec, message = _fallback_message("npu", graph_format="onnx-shared", devices=WITH_NPU)
    assert spec == DeviceSpec("onnxruntime", "cpu") and "shared buffers" in message
    with pytest.raises(DeviceError, match="shared buffers"):
        resolve("npu", strict=True, graph_format="onnx-shared", devices=WITH_NPU)


def test_target_cuda_without_a_bundle_runs_torch_on_the_gpu(monkeypatch):
    """`run --target cuda` (no bundle) asks load_torch for cuda:0 with the draft on --draft."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen = {}
    monkeypatch.setattr(engines, "load_torch", lambda options, mode=None, log=None: seen.update(
        vars(options.models) | vars(options.devices)) or "engine")
    assert engines.load_engine(EngineConfig.from_flags(target="cuda", draft="npu")) == "engine"
    assert seen["device"] == "cuda:0" and seen["draft"] == "npu"
    engines.load_engine(EngineConfig.from_flags(target="cuda:1", model="tiny"))
    assert seen["device"] == "cuda:1" and seen["model"] == "tiny"
    with pytest.raises(engines.GenerationError, match="different"):
        engines.load_engine(EngineConfig.from_flags(target="cuda:1", device="cpu"))


def test_target_cuda_without_cuda_warns_plainly_and_runs_the_default_bundle(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    lines = []
    assert registry.torch_target("cuda", log=lines.append) is None
    assert len(lines) == 1 and "torch sees no CUDA device" in lines[0] and "on the CPU" in lines[0]
    with pytest.raises(DeviceError, match="strict"):
        registry.torch_target("cuda", strict=True)
    with pytest.warns(DeviceFallbackWarning, match="torch:cpu"):
        assert registry.torch_target("torch:cuda") == "cpu"
    assert not registry.names_torch_device("ort:cpu") and not registry.names_torch_device("npu")
    assert registry.names_torch_device("torch:cpu") and registry.names_torch_device("cuda:1")


def test_torch_draft_on_an_accelerator_says_it_runs_on_the_cpu():
    with pytest.warns(DeviceFallbackWarning, match="CPU only"):
        assert registry.torch_draft_device("npu", strict=False) == "torch:cpu"
    with pytest.raises(DeviceError):
        registry.torch_draft_device("cuda", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.torch_draft_device("cpu", strict=True) == "torch:cpu"


@pytest.mark.parametrize("device,expected", [("cpu", False), ("ort:cpu", False), ("torch:cpu", False),
                                             ("openvino:CPU", False), ("cuda", True), ("torch:cuda:1", True),
                                             ("npu", True), ("openvino:GPU.1", True), ("ort:qnn", True)])
def test_is_accelerator(device, expected):
    assert is_accelerator(device) == expected


def test_placement_cuda_target_gives_the_draft_every_core():
    """A CUDA target is not pinned; the CPU draft gets all 16 cores (not one)."""
    placement = plan("torch:cuda:0", "ort:cpu", "mirror", list(range(16)))
    assert placement.target_cpus is None and placement.draft_cpus is None and placement.draft_threads == 16
    assert placement.worker_cores is None
    assert placement.describe() == ("target torch:cuda:0 (thread not pinned); "
                                    "draft ort:cpu, 16 threads (not pinned)")


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_placement_cpu_pair_in_mirror_gives_the_target_all_cores_but_the_drafts(n):
    """Mirror with both on the CPU, nothing measured: the draft one core (the last), the target the other n-1, each
    pinned with a thread per core; 2 cores stay 1 + 1."""
    cores = list(range(100, 100 + n))
    mirror = plan("ort:cpu", "ort:cpu", "mirror", cores)
    assert mirror.target_cpus == tuple(cores[:-1]) and mirror.draft_cpus == (cores[-1],)
    assert (mirror.target_threads, mirror.draft_threads) == (n - 1, 1)
    assert mirror.worker_cores == (tuple(cores[:-1]), (cores[-1],))
    target_where = f"core {cores[0]}" if n == 2 else f"cores {cores[0]}-{cores[-2]}"
    assert mirror.describe() == (f"target ort:cpu, {n - 1} thread{'s' * (n > 2)} pinned to {target_where}; "
                                 f"draft ort:cpu, 1 thread pinned to core {cores[-1]}")
    # the prompt may borrow the draft's core only where it doubles the target's (2 cores)
    assert mirror.prompt_cpus == (tuple(cores) if n == 2 else None)
    for mode in ("sd", "ar"):
        other = plan("ort:cpu", "ort:cpu", mode, cores)
        assert other.worker_cores is None and other.target_threads == n


@pytest.mark.parametrize("n,draft_cores,target_count", [(2, 1, 1), (2, 5, 1), (4, 2, 2), (8, 3, 5), (16, 4, 12),
                                                         (64, 7, 57), (64, 64, 1), (16, 0, 15)])
def test_placement_gives_the_draft_its_measured_share(n, draft_cores, target_count):
    """`draft_cores` (draft_share of measured costs) sets the draft's cores, at least 1 and leaving the target 1."""
    mirror = plan("ort:cpu", "openvino:CPU", "mirror", list(range(n)), draft_cores=draft_cores)
    assert mirror.target_cpus == tuple(range(target_count)) and mirror.draft_cpus == tuple(range(target_count, n))
    assert (mirror.target_threads, mirror.draft_threads) == (target_count, n - target_count)


@pytest.mark.parametrize("n,target_core_ms,draft_core_ms,share", [
    (2, 10.0, 10.0, 1), (2, 1.0, 100.0, 1),  # two cores: always 1 + 1
    (4, 30.0, 10.0, 1), (4, 10.0, 10.0, 2), (4, 10.0, 30.0, 3),
    (8, 70.0, 10.0, 1), (8, 10.0, 10.0, 4), (8, 50.0, 30.0, 3),
    (16, 180.0, 10.0, 1), (16, 180.0, 100.0, 6), (16, 10.0, 30.0, 12),
    (64, 90.0, 10.0, 7), (64, 1.0, 1000.0, 63),  # never the target's last core
    (16, None, 5.0, 1), (16, 5.0, None, 1), (16, 0.0, 5.0, 1), (1, 5.0, 5.0, 1),  # unknown: one core
])
def test_draft_share_ends_the_rollout_with_the_targets_part(n, target_core_ms, draft_core_ms, share):
    assert draft_share(n, target_core_ms, draft_core_ms) == share
    if target_core_ms and draft_core_ms and 1 < share < n - 1:  # the fewest cores that keep up, not one more
        assert draft_core_ms / share <= target_core_ms / (n - share)
        assert draft_core_ms / (share - 1) > target_core_ms / (n - share + 1)


def test_placement_off_mirror_and_overrides_pin_nothing():
    assert plan("ort:cpu", "ort:cpu", "mirror", [0]).worker_cores is None  # one core: nothing to split
    assert plan("ort:cpu", "ort:cpu", "mirror", [0, 1], threads=2).worker_cores is None
    assert plan("ort:cpu", "ort:cpu", "mirror", [3, 5, 6, 7, 9]).describe().startswith(
        "target ort:cpu, 4 threads pinned to cores 3,5-7;")


def test_cpu_torch_engine_reports_its_placement():
    engine = torch_engine.load_torch(EngineConfig.from_flags(model="tiny", draft_model="int8"), log=lambda *a: None)
    assert engine.names["placement"] == plan("torch:cpu", "torch:cpu", "mirror",
                                             sorted(engines.available_cores())).describe()
    assert engine.placement.describe() == engine.names["placement"] and not engine.placement.fallbacks


def test_torch_threads_are_what_the_placement_says_and_at_most_the_cores():
    """`--threads` is torch's count on each worker (its threads share the worker's core where it is pinned);
    more than the usable cores is capped to them, with a warning line."""
    import torch

    cores, lines, previous = len(engines.available_cores()), [], torch.get_num_threads()
    try:
        engine = torch_engine.load_torch(EngineConfig.from_flags(model="tiny", draft_model="int8", threads=1000),
                                         log=lines.append)
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(previous)
    assert engine.placement.target_threads == engine.placement.draft_threads == cores
    assert f"{cores} thread{'s' * (cores != 1)}" in engine.names["placement"]
    assert lines == [f"mirror-rt: warning: --threads 1000 is more than the {cores} core{'s' * (cores != 1)} "
                     f"usable here; using {cores}"]


@pytest.fixture(scope="module")
def onnx_bundle(tmp_path_factory):
    from mirror_rt.exporters.export import export_bundle

    pytest.importorskip("onnxruntime")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_bundle("tiny", tmp_path_factory.mktemp("draft") / "b", fmt="onnx", progress=False)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_torch_target_with_a_bundle_draft(onnx_bundle, mode):
    """The CUDA pairing, on the CPU: a torch target with the ONNX Runtime draft of a bundle (placed by plan),
    lossless, the draft prefilling itself (its KV lives in another backend)."""
    options = EngineConfig.from_flags(target="torch:cpu", draft="cpu", draft_bundle=str(onnx_bundle), model="tiny")
    engine = engines.load_engine(options, mode, log=lambda *a: None)
    assert type(engine.draft).__name__ == "ORTModel" and not engine.draft.capabilities.reads_target_rows
    cores = sorted(engines.available_cores())
    assert engine.names["placement"] == plan("torch:cpu", "ort:cpu", mode, cores).describe()
    ar = engine.generate("hello there", mode="ar", max_new_tokens=24, chat=False)
    assert engine.generate("hello there", mode=mode, max_new_tokens=24, chat=False).tokens == ar.tokens


def test_bundle_draft_of_another_vocabulary_is_refused(onnx_bundle, tmp_path):
    from conftest import write_hf_folder

    folder = write_hf_folder(tmp_path / "m", vocab_size=64)
    with pytest.raises(engines.GenerationError, match="vocabulary mismatch"):
        torch_engine.load_torch(EngineConfig.from_flags(model=str(folder), draft_bundle=str(onnx_bundle)),
                                log=lambda *a: None)


def test_weights_picks_the_default_bundle_at_that_precision(monkeypatch):
    """`--weights q4_1` loads the default model's q4_1 bundle; with --bundle or torch it is refused in one line."""
    from mirror_rt.devices.options import BUNDLE_WEIGHTS
    from mirror_rt.exporters.onnx import WEIGHTS

    assert BUNDLE_WEIGHTS == WEIGHTS  # the flag's choices, kept without importing the exporter (torch) at parse time
    with pytest.raises(engines.GenerationError, match="unknown --weights fp16"):
        engines.default_bundle(weights="fp16")  # (ONNX bundles have no fp16 target)
    asked = []
    monkeypatch.setattr(engines, "default_bundle", lambda cache_dir=None, log=None, weights=None:
                        asked.append(weights) or f"/bundles/{weights}")
    monkeypatch.setattr(engines, "load_bundle", lambda options, mode=None: type("E", (), {
        "names": {}, "bundle": options.models.bundle})())
    assert engines.load_engine(EngineConfig.from_flags(weights="q4_1")).bundle == "/bundles/q4_1"
    assert asked == ["q4_1"]
    for other in ({"bundle": "/some/bundle"}, {"torch": True}, {"model": "tiny"}):
        with pytest.raises(engines.GenerationError, match="--weights q4_1 picks the default model's bundle"):
            engines.load_engine(EngineConfig.from_flags(weights="q4_1", **other))
