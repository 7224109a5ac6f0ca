"""The Python API from several threads at once, and streams their callers drop: `generate` / `stream` from many
threads give each caller its own text (the single-threaded one: steps run one at a time, each decoding every
sequence), and a stream left with `break` and dropped is cancelled and leaves the batch."""

from __future__ import annotations

import gc
import threading

import pytest

from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.torch_engine import load_torch

PROMPTS = ["Explain why the sky is blue.", "Write a haiku about rain.", "What is 2+2?", "Name three fruits."]


@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_threads_calling_at_once_each_get_their_own_text(real_engine, mode):
    reference = {p: real_engine.generate(p, max_new_tokens=16, mode="ar").text for p in PROMPTS}
    assert len(set(reference.values())) == len(PROMPTS)  # mixed-up answers would show
    answers: dict[int, tuple[str, str]] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            if i % 2:
                answers[i] = (prompt, real_engine.generate(prompt, max_new_tokens=16, mode=mode).text)
            else:
                answers[i] = (prompt, "".join(real_engine.stream(prompt, max_new_tokens=16, mode=mode)))
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(answers) == 8
    assert all(text == reference[prompt] for prompt, text in answers.values())
    assert real_engine.pending() == 0


@pytest.fixture(scope="module")
def tiny():
    return load_torch(EngineConfig.from_flags(model="tiny", draft_model="int8"), log=lambda *a: None)


def test_a_dropped_stream_is_cancelled_and_leaves_the_batch(tiny):
    """20 streams (more than the batch's 16 rows) left after one piece, never closed, then dropped: each is
    cancelled once collected, so the next request runs alone (they used to decode to their end, the 17th waited)."""
    reference = tiny.generate("hello world", mode="ar", max_new_tokens=12, ignore_eos=True).tokens
    kept = []
    for i in range(20):
        stream = tiny.stream(f"count {i}", mode="ar", max_new_tokens=300, ignore_eos=True)
        for _ in stream:
            break
        kept.append(stream.cancel_event)
        del stream
        gc.collect()
    again = tiny.generate("hello world", mode="ar", max_new_tokens=12, ignore_eos=True)
    assert again.tokens == reference and tiny.pending() == 0
    assert all(event.is_set() for event in kept)
