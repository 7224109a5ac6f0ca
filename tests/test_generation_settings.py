"""Generation settings given through the Python API: a value of the wrong type is one line naming the setting
(the library's GenerationError from the engine), never a TypeError from deep inside the sampler; the documented
'auto' branch budget and a None stop list are taken."""

from __future__ import annotations

import pytest

from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.torch_engine import load_torch
from mirror_rt.runtime.config import make_config
from mirror_rt.runtime.engine import GenerationError


@pytest.mark.parametrize("options, says", [
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
    ({"temperature": None}, "temperature must be a number, got None"),
    ({"top_p": "1"}, "top_p must be a number"),
    ({"top_k": 1.5}, "top_k must be an integer, got 1.5"),
    ({"stop_strings": [1]}, "stop_strings must be a list of strings"),
    ({"stop_strings": 5}, "stop_strings must be a list of strings, got 5"),
    ({"ignore_eos": "no"}, "ignore_eos must be true or false, got 'no'"),
    ({"branch_budget": 1.5}, "branch_budget must be 'auto' or an integer >= 0, got 1.5"),
    ({"draft_timeout_s": "x"}, "draft_timeout_s must be a number of seconds"),
])
def test_a_setting_of_the_wrong_type_is_named(options, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        make_config(**options)


def test_documented_spellings_are_taken():
    assert make_config(branch_budget="auto").branch_budget is None
    assert make_config(stop_strings=None).stop_strings == ()
    assert make_config(stop_strings=["\n\n", "END"]).stop_strings == ("\n\n", "END")


def test_the_engine_says_generation_error_and_still_serves():
    engine = load_torch(EngineConfig.from_flags(model="tiny"), log=lambda *a: None)
    for options in ({"top_k": 1.5, "temperature": 1.0}, {"max_new_tokens": 0}, {"mode": 5}):
        with pytest.raises(GenerationError):
            engine.generate("hi", **options)
    with pytest.raises(GenerationError, match="config must be a GenerationConfig"):
        engine.generate("hi", config={"max_new_tokens": 4})
    assert engine.generate("hi", max_new_tokens=3, branch_budget="auto", stop_strings=None).tokens
    assert engine.pending() == 0
