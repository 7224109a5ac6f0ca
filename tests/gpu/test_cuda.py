"""The CUDA target path (skipped without a CUDA device; no OpenVINO, no download).

bf16 equality, `--compile` (CUDA graphs), cancel mid-step, and the device->host transfer bound, on the tiny
preset and on SmolLM2-135M's real geometry with random weights. Greedy sd and mirror at bf16 must equal `ar`
at bf16 exactly: every decode step of a bf16 target runs at one window shape. Across targets (CUDA against
CPU, compiled against eager) a mismatch is allowed only at a tie of the target's own logits: there the first
mismatch must have a top-2 margin within a percent of the top logit (a real bug, a wrong position or a stale
KV slot, moves logits far more).
"""

from __future__ import annotations

import math
import threading
import time
import warnings

import pytest
import torch

from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.torch_engine import load_torch as load_options
from mirror_rt.evaluation.device_check import first_mismatch, launches_per_forward
from mirror_rt.runtime.transfer import record_shapes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "The history of the transistor begins with"
QUIET = dict(log=lambda *a: None)


def load_torch(model, draft_model, log, **flags):
    """A torch engine of `model` with `draft_model`, other engine flags by name."""
    return load_options(EngineConfig.from_flags(model=model, draft_model=draft_model, **flags), log=log)


def _assert_equal_or_tie(engine, expected: list[int], got: list[int]) -> None:
    index = first_mismatch(expected, got)
    if index is None:
        return
    with torch.inference_mode():
        prompt = engine.prompt_ids(PROMPT, chat=False)
        logits = engine.target.forward(prompt + expected[:index], engine.target.new_cache(len(prompt) + index + 1),
                                       last_rows=1)[-1].float()
        first, second = torch.topk(logits, 2).values.tolist()
    assert first - second <= 0.01 * abs(first), f"mismatch at {index} with top-2 margin {first - second}"


def _generate(engine, mode: str, tokens: int = 48):
    return engine.generate(PROMPT, mode=mode, max_new_tokens=tokens, ignore_eos=True, chat=False, gamma=4)


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def bf16_engine(request):
    engine = load_torch(request.param, "int8", device="cuda", **QUIET)
    assert engine.names["target_precision"] in ("bf16", "fp16")  # the CUDA default
    assert engine.target.model.inv_freq.dtype == torch.float32  # RoPE frequencies are never rounded to bf16
    return engine


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_bf16_greedy_equals_ar_at_bf16(bf16_engine, mode):
    assert bf16_engine.target.static is not None and bf16_engine.target.static.sizes == (8,)
    expected = _generate(bf16_engine, "ar").tokens
    assert first_mismatch(expected, _generate(bf16_engine, mode).tokens) is None


def test_cuda_ar_fp32_equals_cpu_ar_fp32():
    cuda = load_torch("smollm2-135m", "target", device="cuda", dtype="float32", **QUIET)
    cpu = load_torch("smollm2-135m", "target", device="cpu", dtype="float32", **QUIET)
    _assert_equal_or_tie(cpu, _generate(cpu, "ar", 24).tokens, _generate(cuda, "ar", 24).tokens)


def test_compiled_greedy_equals_eager_and_uses_cuda_graphs():
    eager = load_torch("tiny", "int8", device="cuda", dtype="float32", **QUIET)
    compiled = load_torch("tiny", "int8", device="cuda", dtype="float32", compile=True, **QUIET)
    expected = _generate(eager, "ar").tokens
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    for mode in ("ar", "sd", "mirror"):
        _assert_equal_or_tie(eager, expected, _generate(compiled, mode).tokens)
    assert compiled.target.static.sizes_run
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips  # no graph fell back to eager


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_greedy_reads_back_ids_and_exit_rows_only(bf16_engine, mode):
    """No vocabulary-sized row leaves the GPU; mirror's target synchronizes at most twice per step (the exit's
    ids and log-probs together, then the verify ids), sd's once per verify (the draft's CPU reads cost none)."""
    seen = {}

    def decode():
        with record_shapes() as shapes:
            seen["gen"] = _generate(bf16_engine, mode)
        seen["shapes"] = shapes

    thread = threading.Thread(target=decode)  # the decoding thread's own counters
    thread.start()
    thread.join()
    vocab = bf16_engine.target.vocab_size
    assert seen["shapes"] and max(math.prod(shape) for shape, _ in seen["shapes"]) < vocab
    stats = seen["gen"].stats
    per_step = (4 + 1) * (8 * 8 + 4 * 8 + 8)  # gamma 4, kappa 8: exit ids (int64) + log-probs (fp32) + verify ids
    assert 0 < stats["device_to_host_bytes_per_token"] <= per_step  # 520 B: under a bf16 logits row of SmolLM2's
    assert stats["device_reads_per_step"] <= (2.5 if mode == "mirror" else 1.5)


def test_cancel_mid_step_on_cuda(bf16_engine):
    reference = _generate(bf16_engine, "mirror", 24).tokens
    gen = bf16_engine.stream(PROMPT, mode="mirror", max_new_tokens=400, ignore_eos=True, chat=False)
    consumer = threading.Thread(target=lambda: list(gen))
    consumer.start()
    while len(gen.steps) < 3 and consumer.is_alive():
        time.sleep(0.001)
    steps_at_cancel = len(gen.steps)
    gen.cancel()
    consumer.join(timeout=10)
    assert not consumer.is_alive() and gen.stop_reason == "cancelled"
    assert len(gen.steps) - steps_at_cancel <= 1 and len(gen.tokens) < 400
    deadline = time.monotonic() + 2.0
    while any(t.name == "mirror-draft" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "mirror-draft" and t.is_alive() for t in threading.enumerate())
    assert _generate(bf16_engine, "mirror", 24).tokens == reference


def test_placement_leaves_the_cpu_to_the_draft():
    engine = load_torch("tiny", "int8", device="cuda", **QUIET)
    assert engine.cpus is None and "thread not pinned" in engine.names["placement"]


def test_counting_launches_twice_says_nothing(bf16_engine):
    """`devices --check` counts launches with torch.profiler once per pair: torch's note that a later profiler
    clears the earlier one's events is no line for the user to read."""
    import torch.profiler.profiler as torch_profiler

    getattr(torch_profiler, "_WARNINGS_SHOWN", set()).clear()  # torch warns once per process: as if for the first time
    prompt = bf16_engine.prompt_ids(PROMPT, chat=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = [launches_per_forward(bf16_engine.target, prompt) for _ in range(2)]
    assert counts[0] > 0 and counts[0] == counts[1]
    assert not [w for w in caught if "Profiler" in str(w.message)], [str(w.message) for w in caught]
