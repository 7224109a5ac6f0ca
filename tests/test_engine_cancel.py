"""The engine's cancel hook: `Generation.cancel()` from another thread stops decoding within one step,
stops Mirror's draft thread, and leaves nothing behind for the next generation."""

from __future__ import annotations

import threading
import time

import pytest

from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.torch_engine import load_torch


class SlowSuffix:
    """A split target whose verification takes at least `delay` seconds (so a cancel lands mid-run)."""

    def __init__(self, target, delay: float):
        self.inner, self.delay = target, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_suffix(self, cache, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.forward_suffix(cache, *args, **kwargs)

    def forward(self, tokens, cache):
        time.sleep(self.delay)
        return self.inner.forward(tokens, cache)


@pytest.fixture(scope="module")
def engine():
    return load_torch(EngineConfig.from_flags(model="tiny", draft_model="int8"), log=lambda *a: None)


def draft_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mirror-draft" and t.is_alive()]


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_cancel_stops_within_one_step_and_frees_the_workers(engine, mode):
    """Cancel after the first piece: at most one more step runs, the draft thread is gone, and the
    next generation equals the reference decoder."""
    reference = engine.generate("hello world", mode="ar", max_new_tokens=40, ignore_eos=True).tokens
    slow = SlowSuffix(engine.target, 0.02)
    target, engine.target = engine.target, slow
    engine.reset()  # the decoder is made again around the slow target
    try:
        gen = engine.stream("hello world", mode=mode, max_new_tokens=200, ignore_eos=True)
        consumer = threading.Thread(target=lambda: list(gen))  # decodes as a server's engine thread does
        consumer.start()
        while len(gen.steps) < 3:
            time.sleep(0.001)
        steps_at_cancel = len(gen.steps)
        if mode == "mirror":
            assert draft_threads()  # the draft worker is running while the target verifies
        gen.cancel()  # lands while the consumer is inside a step
        consumer.join(timeout=5)
    finally:
        engine.target = target
        engine.reset()
    assert not consumer.is_alive()
    assert gen.stop_reason == "cancelled"
    assert len(gen.steps) - steps_at_cancel <= 1  # only the step in flight finishes
    assert len(gen.tokens) < 200
    deadline = time.monotonic() + 2.0
    while draft_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not draft_threads()
    again = engine.generate("hello world", mode=mode, max_new_tokens=40, ignore_eos=True)
    assert again.tokens == reference and again.stop_reason == "max_new_tokens"


def test_cancel_before_the_first_step_yields_nothing(engine):
    gen = engine.stream("hello", mode="mirror", max_new_tokens=50)
    gen.cancel()
    assert list(gen) == [] and gen.stop_reason == "cancelled" and gen.tokens == []


@pytest.mark.parametrize("iterated", [True, False])
def test_a_stream_closed_after_break_leaves_the_batch(engine, iterated):
    """`with engine.stream(...) as gen: ... break` (or gen.close()) cancels it: it leaves the batch, keeps its
    text so far, and the next generation equals the reference alone."""
    reference = engine.generate("hello world", mode="ar", max_new_tokens=30, ignore_eos=True).tokens
    with engine.stream("hello", mode="mirror", max_new_tokens=500, ignore_eos=True) as gen:
        for _ in gen if iterated else ():
            break
    if iterated:
        assert gen.finished and gen.stop_reason == "cancelled" and 0 < len(gen.tokens) < 500
    assert gen.cancelled and engine.pending() <= (0 if iterated else 1)
    again = engine.generate("hello world", mode="ar", max_new_tokens=30, ignore_eos=True)
    assert again.tokens == reference and engine.pending() == 0 and gen.stop_reason == "cancelled"
