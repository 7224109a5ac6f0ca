"""Test support for the server: a real uvicorn server on a free port, engine wrappers, a metrics scraper."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx


class RunningServer:
    """The app under uvicorn in a background thread, on a socket bound to a free port."""

    def __init__(self, app):
        import uvicorn

        from mirror_rt.serving.server import uvicorn_config

        self.app, self.state = app, app.state.mirror
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, timeout_graceful_shutdown=2))  # as `mirror-rt serve` runs
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 60.0) -> RunningServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server at {self.url} not ready after {timeout} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                      timeout=kwargs.pop("timeout", 60), **kwargs)


def start(engine, **settings) -> RunningServer:
    """A ready server over `engine` with `ServerConfig(**settings)`."""
    from mirror_rt.serving.app import ServerConfig, create_app

    return RunningServer(create_app(ServerConfig(**settings), lambda: engine)).wait_ready()


class Delayed:
    """A model whose forwards take at least `delay` seconds more (so a request runs long enough to be hit)."""

    def __init__(self, model, delay: float):
        self.inner, self.delay = model, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens, cache, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.forward(tokens, cache, *args, **kwargs)

    def forward_suffix(self, cache, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.forward_suffix(cache, *args, **kwargs)

    def forward_rows(self, tokens, pool, *args, **kwargs):  # a batched target-only step
        time.sleep(self.delay)
        return self.inner.forward_rows(tokens, pool, *args, **kwargs)

    def forward_rows_prefix(self, tokens, pool, *args, **kwargs):  # a speculative step's verify, its first half
        time.sleep(self.delay)
        return self.inner.forward_rows_prefix(tokens, pool, *args, **kwargs)


class Faulty:
    """A model that raises on its `after`-th forward (counted over its whole life)."""

    def __init__(self, model, after: int):
        self.inner, self.after, self.calls = model, after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens, cache, *args, **kwargs):
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError("injected fault")
        return self.inner.forward(tokens, cache, *args, **kwargs)

    def forward_suffix(self, cache, *args, **kwargs):
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError("injected fault")
        return self.inner.forward_suffix(cache, *args, **kwargs)

    def forward_rows(self, tokens, pool, *args, **kwargs):  # a batched target-only step
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError("injected fault")
        return self.inner.forward_rows(tokens, pool, *args, **kwargs)


class Swapped:
    """Context manager: `engine.<role>` replaced by `wrapper(model)` for the duration (the engine's decoder is
    made again around it, on entry and on exit: call it while the server is idle)."""

    def __init__(self, engine, role: str, wrapper):
        self.engine, self.role, self.wrapper = engine, role, wrapper

    def __enter__(self):
        self.original = getattr(self.engine, self.role)
        setattr(self.engine, self.role, self.wrapper(self.original))
        self.engine.reset()
        return getattr(self.engine, self.role)

    def __exit__(self, *exc):
        setattr(self.engine, self.role, self.original)
        self.engine.reset()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels without model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get(("mirror_rt:" + name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, timeout: float = 2.0, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(path, needle: str, proc, timeout: float) -> str:
    """The first line of the log file `path` that contains `needle`, waiting while the process `proc` lives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if needle in line:
                return line
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {path.read_text()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no '{needle}' after {timeout} s: {path.read_text()[-2000:]}")


def tiny_engine(max_seq_len: int = 256):
    """The tiny preset in float64 (greedy equality stays exact whatever the window sizes) with a noisy
    float64 copy as the draft, named as `load_torch` names its engines; it speculates whenever a request's mode
    does (target-only steps would win at every load for models this small: runtime.batch.policy)."""
    from conftest import perturbed_copy, tiny_target

    from mirror_rt.devices.torch.backend import TorchModel
    from mirror_rt.devices.torch.split import TorchSplitTarget
    from mirror_rt.models.tokenizer import ByteTokenizer
    from mirror_rt.runtime.batch.decoder import BatchConfig
    from mirror_rt.runtime.engine import Engine

    target = tiny_target(seed=4, vocab_size=258, max_seq_len=max_seq_len)
    draft = perturbed_copy(target, noise=0.2, seed=5)
    names = {"model": "tiny", "path": "torch eager (cpu)", "target_precision": "fp64", "draft_precision": "fp64",
             "target_device": "torch:cpu", "draft_device": "torch:cpu"}
    return Engine(TorchSplitTarget(target), ByteTokenizer(258), TorchModel(draft), names,
                  batch=BatchConfig(adaptive_speculation=False))


SUBMITTED = "submitted"  # Mortal's log of the generations its engine took


class Mortal:
    """An engine that dies on cue, for the replica tests: a file `crash` in `cues` makes the process exit
    after `after` pieces of the next generation; a file `stop` ends the engine thread at its next step (the
    replica lives on, its engine dead). Whoever removes a cue takes it, so one replica dies. Each generation
    the engine takes adds a line to `submitted` in `cues` (a test waits on it for a request to be admitted)."""

    def __init__(self, engine, cues: str, after: int = 2):
        self.engine, self.cues, self.after = engine, cues, after
        self.stopping = False

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, ids, config, on_piece=None, on_finish=None):
        self.stopping = self.stopping or self._take("stop")
        if self._take("crash"):
            on_piece = crashing(on_piece, self.after)
        generation = self.engine.submit(ids, config, on_piece, on_finish)
        with open(os.path.join(self.cues, SUBMITTED), "a") as log:
            log.write("1\n")
        return generation

    def step(self):
        if self.stopping:
            raise SystemExit("the engine thread stops on cue")
        return self.engine.step()

    def _take(self, cue: str) -> bool:
        try:
            os.remove(os.path.join(self.cues, cue))
            return True
        except FileNotFoundError:
            return False


def crashing(on_piece, after: int):
    """`on_piece` of a generation whose process exits after `after` pieces (a replica lost mid-request)."""
    count = 0

    def piece(gen, text):
        nonlocal count
        if count == after:
            os._exit(1)
        count += 1
        on_piece(gen, text)

    return piece


def replica_engine(cues: str, delay: float = 0.02):
    """The tiny engine as a replica runs it in the tests: forwards slowed by `delay`, dying on cue."""
    engine = tiny_engine()
    engine.target = Delayed(engine.target, delay)
    engine.reset()
    return Mortal(engine, cues)
