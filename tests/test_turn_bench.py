"""The second-turn bench against real servers: with the prefix cache, turn 2 reuses turn 1's blocks (the server's
own counters say so), without it nothing is reused, and both give the same answers."""

from __future__ import annotations

import asyncio
import json

import pytest
from serve_support import start

pytest.importorskip("fastapi")
pytest.importorskip("openai")


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_second_turn_reuses_the_first_only_with_the_prefix_cache(engine, tmp_path, prefix_cache):
    from mirror_rt.evaluation.specbench import read_questions
    from mirror_rt.evaluation.turn_bench import report, run
    from mirror_rt.runtime.batch.decoder import BatchConfig

    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [
        f"Tell me about the number {i} and why it matters to people who count things every day.",
        "And its square?"]}) for i in range(3)))
    engine.batch = BatchConfig(prefix_cache=prefix_cache)
    engine.reset()
    server = start(engine)
    try:
        results = asyncio.run(run([server.url], read_questions(data), max_tokens=24))
    finally:
        server.stop()
    r = results[server.url]
    assert r["questions"] == 3 and r["failed"] == 0 and r["turn2_ttft_ms"] is not None
    assert r["prefix_cache_queries"] > 0 if prefix_cache else r["prefix_cache_queries"] == 0
    # turn 2 holds turn 1 and its answer: at least a 16-token block of each second turn comes from the cache
    assert (r["prefix_cache_hits"] >= 3 * 16) if prefix_cache else r["prefix_cache_hits"] == 0
    assert server.url in report(results, 24)
