"""Token rules on a CUDA target (skipped without a CUDA device): constrained and penalised greedy sd and mirror
equal ar at bf16, and with a grammar, penalties and top-5 logprobs no vocabulary-sized row leaves the GPU
(only the mask's bits travel to it, only ids and a few values come back)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.torch_engine import load_torch
from mirror_rt.runtime.grammar import Constraint
from mirror_rt.runtime.transfer import record_shapes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 999},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
RULES = dict(constraint=Constraint.json_schema(SCHEMA), presence_penalty=0.5, logprobs=5)


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def engine(request):
    config = EngineConfig.from_flags(model=request.param, draft_model="int8", device="cuda")
    return load_torch(config, log=lambda *a: None)


def generate(engine, mode: str):
    return engine.generate("hello", mode=mode, max_new_tokens=48, temperature=0, chat=False, gamma=4, **RULES)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_constrained_greedy_equals_ar_on_cuda(engine, mode):
    expected, got = generate(engine, "ar"), generate(engine, mode)
    assert got.tokens == expected.tokens
    assert [e.token for e in got.logprobs] == [e.token for e in expected.logprobs]


def test_rules_read_back_no_vocabulary_row(engine):
    seen = {}

    def decode():
        with record_shapes() as shapes:
            seen["gen"] = generate(engine, "mirror")
        seen["shapes"] = shapes

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join()
    assert seen["gen"].logprobs and max(math.prod(shape) for shape, _ in seen["shapes"]) < engine.target.vocab_size
