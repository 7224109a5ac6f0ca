"""bench-serve's in-process peer (OpenVINO GenAI's ContinuousBatchingPipeline): the closed loop, its tokens on
the tiny preset, and the side-by-side table against a real server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

genai = pytest.importorskip("openvino_genai")

PROMPTS = [[5, 70, 80, 90, 100, 33, 44], [7, 8, 9], [200, 3, 50, 60], [11, 12, 13, 14, 15]]


class FakeHandle:
    """A request of FakePipe: one token per step (the prompt's first id, then counting), `limit` tokens."""

    def __init__(self, prompt: list[int], limit: int):
        self.prompt, self.limit, self.made, self.unread = prompt, limit, 0, []

    def can_read(self):
        return bool(self.unread)

    def read(self):
        out, self.unread = self.unread, []
        return {0: SimpleNamespace(generated_ids=out)}

    def get_status(self):
        return SimpleNamespace(name="RUNNING" if self.made < self.limit else "FINISHED")


class FakePipe:
    """add_request / step like the pipeline's; records how many requests each step ran."""

    def __init__(self):
        self.handles, self.batch_per_step = [], []

    def add_request(self, request_id, tensor, config):
        handle = FakeHandle(tensor.data[0].tolist(), config.max_new_tokens)
        self.handles.append(handle)
        return handle

    def step(self):
        running = [h for h in self.handles if h.made < h.limit]
        self.batch_per_step.append(len(running))
        for h in running:
            h.unread.append(h.prompt[0] + h.made)
            h.made += 1


def _peer(pipe):
    from mirror_rt.evaluation.genai_serve import ContinuousBatchingPeer

    return ContinuousBatchingPeer("fake", pipe, {"weights": "fp32", "compute": "fp32", "kv": "fp32"}, 1)


def test_closed_loop_keeps_n_in_flight_and_refills_at_once():
    """Concurrency 3 over 4 prompts of 5 tokens: 3 run together, the 4th joins the step after one finishes."""
    pipe = FakePipe()
    results, wall = _peer(pipe).run_level(PROMPTS, 5, 3, decode=lambda ids: ",".join(map(str, ids)))
    assert pipe.batch_per_step == [3, 3, 3, 3, 3, 1, 1, 1, 1, 1]
    assert [r.text for r in results] == [",".join(str(p[0] + i) for i in range(5)) for p in PROMPTS]
    assert all(r.ok and r.tokens == 5 and len(r.token_gaps) == 4 and 0 < r.ttft <= r.e2e <= wall for r in results)


def test_concurrency_one_runs_requests_one_after_another():
    pipe = FakePipe()
    results, _ = _peer(pipe).run_level(PROMPTS[:2], 3, 1)
    assert pipe.batch_per_step == [1] * 6 and [r.tokens for r in results] == [3, 3]


@pytest.fixture(scope="module")
def tiny_peers(tmp_path_factory):
    """The two GenAI peers on the tiny preset, each in its own process: where one dies building (a SIGFPE at 1
    thread and bf16 on AMX Xeons), the tests that need it are skipped with the reason, and the run goes on."""
    from mirror_rt.evaluation.peer_process import serve_peers

    cache = str(tmp_path_factory.mktemp("cache"))
    peers = serve_peers(["ov-genai-cb", "ov-genai-cb-f32"], "tiny", 1, cache=cache, log=lambda *_: None)
    dead = [f"{p.name}: {p.skipped}" for p in peers if getattr(p, "skipped", None)]
    if dead:
        pytest.skip("; ".join(dead))
    return peers


def test_f32_peer_batches_our_reference_tokens(tiny_peers):
    """At f32 every request of a batch of 3 gets the greedy tokens our reference makes for its prompt alone."""
    from mirror_rt.devices.torch.backend import TorchModel
    from mirror_rt.models.loading import load_checkpoint
    from mirror_rt.runtime.reference import generate

    f32 = tiny_peers[1]
    assert f32.precision == {"weights": "fp32", "compute": "fp32", "kv": "fp32"}
    results, _ = f32.run_level(PROMPTS, 10, 3, decode=lambda ids: list(ids))
    target = TorchModel(load_checkpoint("tiny").model)
    expected = [[t for chunk in generate(target, prompt, 10) for t in chunk] for prompt in PROMPTS]
    assert [r.text for r in results] == expected
    assert all(r.ok and r.tokens == 10 and r.ttft is not None and len(r.token_gaps) == 9 for r in results)


def test_default_peer_names_what_the_plugin_compiled(tiny_peers):
    """The default row is labelled with the compute and KV precisions the CPU plugin picks by default here."""
    import openvino as ov

    core = ov.Core()
    compute = core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    key = core.get_property("CPU", "KEY_CACHE_PRECISION").get_type_name()
    default = tiny_peers[0]
    assert default.precision["compute"] == {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}[compute]
    assert default.precision["kv"].startswith({"f32": "fp32"}.get(key, key))
    assert default.label.startswith("openvino genai ContinuousBatchingPipeline, 1 threads")
    assert default.where == "own process (no HTTP)"


def test_unknown_peer_is_refused():
    from mirror_rt.evaluation.genai_serve import load_peers

    with pytest.raises(ValueError, match="unknown bench-serve peer"):
        load_peers(["ov-genai-cb", "vllm"], "tiny", 1)


def test_load_run_puts_the_peers_beside_the_server(engine, tiny_peers):
    """Against a real server: each level's table has our HTTP row and one row per peer, every request done."""
    pytest.importorskip("fastapi")
    from serve_support import start

    from mirror_rt.evaluation.serve_bench import load_run

    server, lines = start(engine, max_queued=4), []
    try:
        prompts = [[{"role": "user", "content": f"question {i}: " + "say it in a few words " * 6}] for i in range(3)]
        report = asyncio.run(load_run(server.url, prompts, [1, 2], 6, burst_size=0, api_key=None, log=lines.append,
                                      peers=tiny_peers))
    finally:
        server.stop()
    assert report["ours"].startswith("mirror; fp64 target, fp64 draft")
    tables = [line for line in lines if line.startswith("concurrency") and "|" in line]
    assert len(tables) == 2 and all(len(t.splitlines()) == 6 for t in tables)
    assert "| mirror-rt serve | mirror; fp64 target, fp64 draft | HTTP | 3/3 |" in tables[0]
    assert report["levels"][1]["prefix_cache_hit_rate"] > 0  # the same prompts again: the server's cache serves them
    assert any("serve with --no-prefix-cache to compare like with like" in line for line in lines)
    for level in report["levels"]:
        assert level["completed"] == 3 and set(level["peers"]) == {"ov-genai-cb", "ov-genai-cb-f32"}
        assert all(p["completed"] == 3 and p["output_throughput"] > 0 for p in level["peers"].values())
