"""bench-serve's in-process row of our own engine (evaluation.engine_peer): the closed loop over Engine.submit /
step, the engine it loads from what the server reports, and the table beside the server's row."""

from __future__ import annotations

import asyncio
import json

import pytest

from mirror_rt.evaluation.engine_peer import EnginePeer
from mirror_rt.runtime.reference import generate

PROMPTS = [[5, 70, 80, 90, 100, 33, 44], [7, 8, 9], [200, 3, 50, 60], [11, 12, 13, 14, 15]]


def following(engine, mode: str = "mirror") -> EnginePeer:
    peer = EnginePeer()
    peer.engine, peer.mode = engine, mode
    return peer


def test_engine_row_runs_the_closed_loop_with_the_reference_tokens(engine):
    peer = following(engine)
    texts = []
    results, wall = peer.run_level(PROMPTS, 10, 2, decode=lambda ids: texts.append(ids) or "text")
    # a gap per token after the first step's tokens (a speculative step commits several)
    assert wall > 0 and all(r.ok and r.tokens == 10 and r.ttft > 0 and 0 < len(r.token_gaps) <= 9 for r in results)
    assert all(r.e2e >= r.ttft for r in results) and [r.text for r in results] == ["text"] * 4
    for prompt, ids in zip(PROMPTS, texts):  # greedy, ignore_eos: the target's own continuation
        assert ids == [t for step in generate(engine.target, prompt, 10) for t in step]


def test_concurrency_bounds_the_sequences_in_flight(engine):
    peer, batches = following(engine), []
    step = engine.step

    def counted():
        batches.append(engine.pending())
        return step()

    engine.step = counted
    try:
        peer.run_level(PROMPTS, 6, 3)
    finally:
        del engine.step
    assert max(batches) == 3 and batches[0] == 3  # three at once from the first step, never more


def test_it_loads_what_the_server_reports(engine, monkeypatch):
    from mirror_rt.devices import engines

    asked = {}

    def load_engine(options, mode, log=None):
        asked.update(weights=options.precision.weights, mode=mode)
        return engine

    monkeypatch.setattr(engines, "load_engine", load_engine)
    peer = EnginePeer()
    with pytest.raises(RuntimeError, match="did not say which precision"):
        peer.run_level(PROMPTS, 4, 1)
    peer.follow({"target": "w8a8", "draft": "q4_1"}, "sd")
    assert asked == {"weights": "w8a8", "mode": "sd"}
    assert not engine.batch.prefix_cache  # the bench repeats its prompts: a cache would skip them
    with pytest.raises(ValueError, match="the server runs /models/other-bundle"):  # not what the server runs
        peer.follow({"target": "fp32"}, "mirror", "/models/other-bundle")
    assert peer.precision_label == "sd; fp64 target, fp64 draft"  # what the loaded engine says it runs
    peer.follow({"target": "fp32"}, "ar")
    assert peer.precision_label == "ar; fp64 target"  # as the server's label: ar runs no draft


def test_load_run_puts_our_engine_beside_our_server(engine, reference, monkeypatch):
    """Against a real server: the engine row follows the server's mode and precision and writes its text."""
    pytest.importorskip("fastapi")
    from serve_support import start

    from mirror_rt.devices import engines
    from mirror_rt.evaluation.serve_bench import load_run

    monkeypatch.setattr(engines, "load_engine", lambda options, mode, log=None: reference)
    server, lines = start(engine, max_queued=4), []
    try:
        prompts = [[{"role": "user", "content": f"question {i}: say it in a few words"}] for i in range(3)]
        report = asyncio.run(load_run(server.url, prompts, [1, 2], 6, burst_size=0, api_key=None, log=lines.append,
                                      peers=[EnginePeer()]))
    finally:
        server.stop()
    tables = [line for line in lines if line.startswith("concurrency") and "|" in line]
    assert len(tables) == 2
    assert "| mirror-rt-engine | mirror; fp64 target, fp64 draft | in process (no HTTP) | 3/3 |" in tables[0]
    for level in report["levels"]:
        assert level["peers"]["mirror-rt-engine"]["same_text_as_ours"] == 3  # the same engine writes the same text


def test_unknown_peer_is_refused_in_one_line(tmp_path, capsys):
    from mirror_rt.cli import main

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["hi"]}) + "\n")
    code = main(["bench-serve", "--url", "http://127.0.0.1:9", "--data", str(data), "--peers", "mirror-rt-engine,vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1
    assert "unknown bench-serve peer(s): vllm (known: mirror-rt-engine, ov-genai-cb, ov-genai-cb-f32)" in err[0]
