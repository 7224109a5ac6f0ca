"""`mirror_rt.load()` / `load_bundle()` with options of the wrong type or range: one line naming the option,
before anything loads (threads=-1 was torch's RuntimeError, model=5 a TypeError, model='' loaded torch, an
unknown draft_precision was taken)."""

from __future__ import annotations

import pytest

import mirror_rt


@pytest.mark.parametrize("options, says", [
    ({"threads": -1}, "threads must be a whole number >= 1, got -1"),
    ({"threads": 0}, "threads must be a whole number >= 1, got 0"),
    ({"model": 5}, "model must be a path or a name, got 5"),
    ({"model": ""}, "model must be a path or a name, got ''"),
    ({"draft_precision": "x"}, "draft_precision must be one of f32, bf16, got 'x'"),
    ({"torch": "yes"}, "torch must be true or false, got 'yes'"),
    ({"device": "npu"}, "device must be torch's device for the target: cpu, cuda or cuda:N, got 'npu'"),
    ({"device": "meta"}, "device must be torch's device for the target"),  # was torch's NotImplementedError
    ({"device": ""}, "device must be torch's device for the target"),  # was the CPU, silently
    ({"dtype": ""}, "dtype must be one of float32, bfloat16"),
    ({"exit_layer": 1.5}, "--exit-layer must be a whole number, got 1.5"),  # was a TypeError naming nothing
    ({"kappa": 1.5}, "--kappa must be a whole number, got 1.5"),  # was taken
    ({"kappa": True}, "--kappa must be a whole number, got True"),  # was taken as 1
    ({"kv_cache_gb": "x"}, "--kv-cache-gb must be a number > 0, got 'x'"),  # was a TypeError naming nothing
    ({"max_num_seqs": 2.5}, "--max-num-seqs must be a whole number >= 1, got 2.5"),
    ({"compile": "no"}, "compile must be true or false, got 'no'"),  # compiled
    ({"prefix_cache": "no"}, "prefix_cache must be true or false, got 'no'"),  # was taken
])
def test_load_refuses_options_it_cannot_use(options, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        mirror_rt.load(**options)


def test_load_bundle_needs_a_folder():
    with pytest.raises(ValueError, match="load_bundle needs a bundle's folder"):
        mirror_rt.load_bundle(None)
