"""CUDA target with an OpenVINO CPU draft (skipped without a CUDA device)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    from mirror_rt.exporters.export import export_bundle

    root = tmp_path_factory.mktemp("gpu")
    return (export_bundle("tiny", root / "torch", fmt="torch", progress=False),
            export_bundle("tiny", root / "ov", fmt="openvino", progress=False))


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_cuda_target_openvino_cpu_draft_equals_ar(bundles, mode):
    import mirror_rt

    torch_bundle, ov_bundle = bundles
    engine = mirror_rt.load_bundle(str(torch_bundle), target_device="torch:cuda", draft_device="openvino:CPU",
                                   draft_bundle=str(ov_bundle), strict_devices=True, mode=mode)
    assert engine.target.device.type == "cuda"
    ar = engine.generate("hello world", mode="ar", max_new_tokens=40)
    got = engine.generate("hello world", mode=mode, max_new_tokens=40, gamma=4)
    assert got.tokens == ar.tokens
