"""The device boundary: greedy verify reads back k+1 ids, the early exit kappa ids and log-probs per row,
and no vocabulary-sized row ever crosses (mirror-sd.md §4). CPU torch models return tensors just as
CUDA ones do, so the same reads are counted here."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import decode, flat, perturbed_copy, tiny_target

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.devices.torch.split import TorchSplitTarget
from mirror_rt.runtime.acceptance import verify
from mirror_rt.runtime.reference import generate
from mirror_rt.runtime.sampling import SamplingConfig
from mirror_rt.runtime.transfer import PendingRead, counters, record_shapes, to_host

PROMPT = [5, 17, 42, 9, 80, 33]
GAMMA, KAPPA = 4, 3


@pytest.fixture
def pair():
    target = tiny_target(seed=3)
    return target, perturbed_copy(target, noise=0.4, seed=7)


def _largest(shapes) -> int:
    return max(int(np.prod(shape)) for shape, _ in shapes)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_sd_reads_ids_only(pair, static):
    """Per verify: k+1 ids; the draft's choices: its ids; prefill: one id; nothing vocabulary-sized (padded static
    windows alike). sd drafts in this thread, so its reads are counted too."""
    target, draft = pair
    model = TorchModel(target, static=static)
    vocab = model.vocab_size
    with record_shapes() as shapes:
        got = decode(model, TorchModel(draft), PROMPT, max_new_tokens=30, gamma=GAMMA).tokens
    assert got == flat(generate(TorchModel(target), PROMPT, 30))
    target_reads = [shape for shape, _ in shapes if len(shape) == 1]
    assert target_reads and all(1 <= n <= GAMMA + 1 for (n,) in target_reads)
    assert _largest(shapes) < vocab  # no vocabulary-sized row through the boundary


def test_greedy_mirror_target_reads_exit_rows_and_ids_only(pair):
    """The target thread reads [k+1, kappa] exit ids and log-probs and k+1 verify ids per step, nothing more."""
    target, draft = pair
    split = TorchSplitTarget(target, kappa=KAPPA)
    with record_shapes() as shapes:
        got = decode(split, TorchModel(draft), PROMPT, mode="mirror", max_new_tokens=30, gamma=GAMMA, early_exit="on")
    assert got.tokens == flat(generate(TorchModel(target), PROMPT, 30))
    assert any(len(shape) == 2 and shape[1] == KAPPA for shape, _ in shapes)  # the exit was read
    assert _largest(shapes) <= (GAMMA + 1) * KAPPA < split.vocab_size
    per_step = (GAMMA + 1) * (8 * KAPPA + 4 * KAPPA + 8)  # exit ids (int64) + log-probs (fp32) + verify ids
    read = sum(int(np.prod(shape)) * (4 if len(shape) == 2 else 8) for shape, _ in shapes)
    assert 0 < read <= per_step * got.stats["steps"] + 8  # the prefill's first token: one id


def test_sampled_verify_reads_a_few_probabilities_not_rows(pair):
    """Sampling reads the chosen ids (the target's k+1, the draft's one a token): still nothing vocabulary-sized."""
    target, draft = pair
    with record_shapes() as shapes:
        decode(TorchModel(target), TorchModel(draft), PROMPT, max_new_tokens=20, gamma=GAMMA,
               sampling=SamplingConfig(temperature=1.0), seed=1)
    assert shapes and _largest(shapes) <= GAMMA + 1


def test_the_record_sees_a_vocabulary_row_when_one_is_read():
    """The checks above can fail: reading a logits row is recorded with its size; on the CPU no bytes
    cross a device (the counters count accelerator reads only)."""
    logits = torch.zeros(3, 97)
    before = counters()
    with record_shapes() as shapes:
        to_host(logits[-1])
    assert shapes == [((97,), "cpu")] and counters() == before


def test_accelerator_reads_are_counted(monkeypatch):
    """Bytes and reads of a tensor on an accelerator (simulated: the count looks at the device type)."""
    from mirror_rt.runtime import transfer

    class OnDevice:
        device = torch.device("meta")
        shape = (5,)

        def numel(self):
            return 5

        def element_size(self):
            return 8

    before = counters()
    transfer._count(OnDevice())
    assert counters() == (before[0] + 40, before[1] + 1)


def test_greedy_ids_read_only_argmaxes():
    logits = torch.zeros(4, 50)
    logits[torch.arange(4), torch.tensor([5, 7, 3, 4])] = 1.0
    with record_shapes() as shapes:
        verdict = verify(logits, [5, 7, 9], 0, SamplingConfig(), seed=0)
    assert (verdict.num_accepted, verdict.next_token) == (2, 3) and shapes == [((4,), "cpu")]


def test_host_arrays_cost_nothing():
    """ONNX Runtime / OpenVINO logits are host arrays: deciding on them reads nothing across a device."""
    logits = np.zeros((2, 10))
    logits[0, 3] = logits[1, 4] = 1.0
    with record_shapes() as shapes:
        assert verify(logits, [3], 0, SamplingConfig(), seed=0).next_token == 4
    assert shapes == []


def test_records_are_per_thread():
    seen = {}

    def other():
        with record_shapes() as shapes:
            to_host(torch.zeros(10))
        seen["shapes"] = shapes

    with record_shapes() as mine:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen["shapes"] == [((10,), "cpu")] and mine == []


def test_pending_read_on_cpu_reads_at_once():
    ids, values = PendingRead(torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.25]])).result()
    assert ids.tolist() == [[1, 2]] and values.tolist() == [[0.5, 0.25]]


def test_an_asynchronous_target_queues_its_suffix_before_reading_its_exit(pair):
    """A CUDA target (simulated: `Capabilities.asynchronous`) launches prefix and exit, queues the suffix, then
    reads the exit back and sends it; the output is unchanged."""
    target, draft = pair
    split = TorchSplitTarget(target, kappa=KAPPA)
    split.capabilities = replace(split.capabilities, asynchronous=True)
    calls = []
    launch, suffix = split.launch_prefix, split.forward_suffix

    def launch_prefix(tokens, cache):
        pending = launch(tokens, cache)
        result = pending.result
        pending.result = lambda: calls.append("read exit") or result()
        calls.append("launch prefix")
        return pending

    split.launch_prefix = launch_prefix
    split.forward_suffix = lambda cache, *a: calls.append("queue suffix") or suffix(cache, *a)
    got = decode(split, TorchModel(draft), PROMPT, mode="mirror", max_new_tokens=30, gamma=GAMMA, early_exit="on")
    assert got.tokens == flat(generate(TorchModel(target), PROMPT, 30))
    step = calls.index("launch prefix")
    assert calls[step:step + 3] == ["launch prefix", "queue suffix", "read exit"]
