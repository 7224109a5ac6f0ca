"""Our own engine as a row of `mirror-rt bench-serve`, run in the client's process as genai_serve runs GenAI's pipeline
(`Engine.submit`, then `Engine.step` in a closed loop): the engine the server runs (the default model at its target
precision, no prefix cache), so its gap to the server's row is what HTTP costs, and to GenAI's the engines alone.
"""

from __future__ import annotations

import time
from dataclasses import replace

from mirror_rt.evaluation.genai_serve import Flight, closed_loop
from mirror_rt.evaluation.serve_bench import Result

NAME = "mirror-rt-engine"


class EngineFlight(Flight):
    """One request in flight on our engine (`handle`: its runtime.generation.Generation); the timing is GenAI's."""

    def new_ids(self) -> list[int]:
        return list(self.handle.sequence.tokens[len(self.ids):])

    def finished(self) -> bool:
        return self.handle.finished

    def succeeded(self) -> bool:
        return self.handle.stop_reason not in ("error", "cancelled")


class EnginePeer:
    """The server's engine, loaded in this process once the server says which precision it runs (`follow`)."""

    name = NAME
    where = "in process (no HTTP)"

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir
        self.engine = None
        self.precision: dict = {}
        self.mode: str | None = None
        self.label = self.precision_label = "mirror-rt engine (not loaded)"

    def follow(self, precision: dict, mode: str | None, path: str | None = None) -> None:
        """Load the default model's bundle at the server's target precision, in the server's mode; ValueError when
        that is not what the server runs (`path`: the server's model path, as its answers report it)."""
        from pathlib import Path

        from mirror_rt.devices.engines import load_engine
        from mirror_rt.devices.options import EngineConfig

        weights = precision.get("target")
        self.engine = load_engine(EngineConfig.from_flags(cache_dir=self.cache_dir, weights=weights), mode,
                                  log=lambda *a: None)
        # no prefix cache, as the GenAI peers: every level repeats the same prompts, which a cache would skip
        self.engine.batch = replace(self.engine.batch, prefix_cache=False)
        self.mode = mode or self.engine.default_mode
        names = self.engine.names
        if path is not None and Path(path).name != Path(names.get("path", "")).name:
            raise ValueError(f"{NAME} runs the default model's bundle ({names.get('path')}); the server runs {path} "
                             f"(drop {NAME} from --peers)")
        # the roles this mode runs, as the server's answers name them (serving.records): no draft for ar
        self.precision = {"target": names.get("target_precision"),
                          "draft": names.get("draft_precision") if self.mode != "ar" else None}
        roles = ", ".join(f"{p} {role}" for role, p in self.precision.items() if p)
        self.precision_label = f"{self.mode}; {roles}"
        self.label = f"mirror-rt engine, {self.precision_label}"

    def run_level(self, prompts: list[list[int]], max_tokens: int, concurrency: int,
                  decode=None) -> tuple[list[Result], float]:
        """`closed_loop` over the engine: (results in prompt order, wall seconds)."""
        if self.engine is None:
            raise RuntimeError(f"{NAME}: the server did not say which precision it runs (not a mirror-rt server?)")
        config = self.engine.config_for(max_new_tokens=max_tokens, ignore_eos=True, mode=self.mode)

        def submit(ids: list[int]) -> EngineFlight:
            return EngineFlight(self.engine.submit(list(ids), config), time.perf_counter())

        return closed_loop(prompts, concurrency, submit, self.engine.step, decode)


def engine_peers(cache_dir: str | None = None, log=print) -> list:
    """The engine row, as evaluation.peer_process builds it in a child process (it loads once the server says what
    it runs)."""
    return [EnginePeer(cache_dir)]
