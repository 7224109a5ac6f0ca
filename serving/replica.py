"""One Ray Serve replica: the single server's app over the replica's own engine (Ray imported lazily).

A replica loads its engine in its constructor, then serves `create_app`'s routes, each response naming it in
`x-mirror-rt-replica` (its Serve tag) and every metric also recorded through `ray.serve.metrics`. `check_health`
fails once the engine thread is dead; `answer` (the proxy's `LIGHT` requests) and `drain` are broadcast to every
replica. A replica that asked for whole CPUs first pins itself to that many cores chosen by its rank on the node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

from mirror_rt.runtime.affinity import available_cores
from mirror_rt.serving.app import ServerConfig, create_app
from mirror_rt.serving.proxy import DEPLOYMENT, REPLICA_HEADER, call_app
from mirror_rt.serving.server import drain_scheduler


class ReplicaHeader:
    """ASGI middleware: `x-mirror-rt-replica: <tag>` on every response."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER, replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return await self.app(scope, receive, send_named)


def health_problem(state) -> str | None:
    """Why a replica's app cannot serve (`serving.app.ServerState`), or None when it can."""
    if state.status == "failed":
        return f"the engine failed to load: {state.error}"
    if state.status == "ready" and not state.scheduler.alive():
        return "the engine thread is dead"
    return None


def own_cores(cores: list[int], num_cpus: int, local_rank: int) -> list[int] | None:
    """`num_cpus` of `cores` after those of the lower ranks (wrapping round); None when it should not pin (no
    whole CPU asked for, or all of them)."""
    if num_cpus < 1 or num_cpus >= len(cores):
        return None
    first = local_rank * num_cpus
    return [cores[(first + i) % len(cores)] for i in range(num_cpus)]


def pin_replica(num_cpus: float, rank) -> list[int] | None:
    """Pin every thread of this process (later ones inherit it) to its own cores (`own_cores`); the cores, or None
    when it did not."""
    if rank is None or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return None
    cores = own_cores(sorted(available_cores()), int(num_cpus), rank.local_rank)
    for task in os.listdir("/proc/self/task") if cores is not None else ():
        try:
            os.sched_setaffinity(int(task), cores)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    return cores


# --- Ray's metrics as a `serving.metrics.Sink` --------------------------------------------------


class RayFamily:
    """One metric in `ray.serve.metrics` with prometheus_client's `.labels(...)` style: a `serving.metrics.Sink`."""

    def __init__(self, kind: str, name: str, doc: str, label_names: list, buckets: tuple | None):
        from ray.serve import metrics

        name, keys = "mirror_rt_" + name, tuple(label_names)
        if kind == "histogram":
            self.metric = metrics.Histogram(name, doc, boundaries=list(buckets), tag_keys=keys)
        else:
            self.metric = {"counter": metrics.Counter, "gauge": metrics.Gauge}[kind](name, doc, tag_keys=keys)
        self.label_names = label_names

    def labels(self, *values) -> RayChild:
        return RayChild(self.metric, dict(zip(self.label_names, map(str, values))))


class RayChild:
    """A Ray metric with its tag values bound."""

    def __init__(self, metric, tags: dict):
        self.metric, self.tags = metric, tags

    def inc(self, amount: float = 1) -> None:
        if amount > 0:  # Ray's counters refuse 0
            self.metric.inc(amount, tags=self.tags)

    def set(self, value: float) -> None:
        self.metric.set(value, tags=self.tags)

    def observe(self, value: float) -> None:
        self.metric.observe(value, tags=self.tags)


# --- the deployment ------------------------------------------------------------------------------


def replica_deployment(options: dict):
    """The Serve deployment of the app, with `serve.deployment` options (resources, limits...)."""
    from ray import serve

    @serve.deployment(name=DEPLOYMENT, **options)
    @serve.ingress()
    class MirrorReplica:
        """One engine behind the app; Serve runs as many as the deployment asks for."""

        async def __init__(self, settings: ServerConfig, load, queue: int):
            # an engine thread that dies ends the replica before it answers: the proxy resends the request
            self.settings = dataclasses.replace(settings, exit_on_engine_death=True)
            self.queue = queue  # its own queue; `settings.max_queued` waits at the proxy, and /server says so
            pin_replica(options.get("ray_actor_options", {}).get("num_cpus", 0), serve.get_replica_context().rank)
            self.engine = await asyncio.to_thread(load)
            self.state = self.asgi = None

        def __serve_build_asgi_app__(self):
            engine, tag = self.engine, serve.get_replica_context().replica_tag
            app = create_app(self.settings, lambda: engine, metrics_sink=RayFamily)
            app.add_middleware(ReplicaHeader, replica=tag)
            self.state, self.asgi = app.state.mirror, app
            return app

        async def check_health(self):
            while self.state is None or self.state.status == "loading":  # the app attaches its engine
                await asyncio.sleep(0.05)
            if self.state.scheduler is not None:  # before the first request: Serve routes after this check
                self.state.scheduler.max_queued = self.queue
                self.state.scheduler.queue_source = "each replica's own, the rest wait at the proxy"
            problem = health_problem(self.state)
            if problem:
                raise RuntimeError(problem)

        async def answer(self, method: str, path: str, query: bytes, headers: list) -> tuple:
            """A `proxy.LIGHT` request answered in-process, outside Serve's request limits."""
            return await call_app(self.asgi, method, path, query, headers)

        async def drain(self, timeout: float) -> bool:
            """The single server's drain (`serving.server.drain_scheduler`); True when all finished."""
            self.state.status = "draining"
            if self.state.scheduler is None:
                return True
            return await asyncio.to_thread(drain_scheduler, self.state.scheduler, timeout)

    return MirrorReplica
