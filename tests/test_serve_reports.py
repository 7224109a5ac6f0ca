"""What ran is what is reported (a real server on a free port, the official openai client): a request that asked
for speculation says whether it speculated and, for each step that did not, why (the load policy measured
target-only faster, prompts were read beside it, ...); it said `mode: "mirror"` with `speculative_steps: 0` and no
reason."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from serve_support import Delayed, start, tiny_engine

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def adaptive_server(policy=None):
    engine = tiny_engine()
    engine.batch = dataclasses.replace(engine.batch, adaptive_speculation=True)
    engine.target = Delayed(engine.target, 0.01)
    engine.reset()
    if policy is not None:
        engine.decoder.policy = policy
    return start(engine)


def ask(server, content: str, max_tokens: int, **extra):
    return server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        extra_body={"mode": "mirror", "ignore_eos": True, **extra})


def test_a_request_the_policy_decoded_target_only_says_so_and_why():
    from mirror_rt.runtime.batch.policy import AR, SpeculationPolicy

    class TargetOnlyWins(SpeculationPolicy):
        def choose(self, batch: int, ways: tuple = ()) -> str:
            self.reason = "slower"
            return AR

    server = adaptive_server(TargetOnlyWins(adaptive=True))
    try:
        report = ask(server, "hi", 60).model_extra["mirror_rt"]
    finally:
        server.stop()
    assert report["mode"] == "mirror" and report["speculated"] is False and report["speculative_steps"] == 0
    reasons = report["target_only_steps"]  # its own prompt's step, the policy's choice, the last 15 tokens
    assert set(reasons) == {"prompts", "slower", "tail"} and sum(reasons.values()) == report["steps"], reasons
    assert report["why_target_only"].startswith(f"no speculation: the load policy measured speculation slower "
                                                f"than target-only decoding at this batch size ({reasons['slower']} "
                                                f"steps); ")


def test_steps_beside_another_prompt_say_so():
    """A stream running when a long prompt arrives: the steps that read that prompt decode target-only (the adaptive
    policy's rule), and its report counts them by reason; every step is either speculative or explained."""
    server = adaptive_server()
    try:
        first, reports = threading.Event(), []

        def stream():
            chunks = server.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=150, temperature=0,
                stream=True, extra_body={"mode": "mirror", "ignore_eos": True})
            for index, chunk in enumerate(chunks):
                if index == 5:
                    first.set()
                if chunk.model_extra.get("mirror_rt"):
                    reports.append(chunk.model_extra["mirror_rt"])

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        ask(server, "a long question " * 12, 4)
        reader.join(60)
    finally:
        server.stop()
    report = reports[-1]
    assert report["speculated"] is True and report["target_only_steps"].get("prompts", 0) >= 1, report
    assert report["speculative_steps"] + sum(report["target_only_steps"].values()) == report["steps"]
    assert report["why_target_only"].startswith(f"speculated in {report['speculative_steps']} of {report['steps']}")
    assert "a prompt was being read in the same step" in report["why_target_only"]
