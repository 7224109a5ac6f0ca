"""`mirror-rt serve --replicas N`: the app (`serving.replica`) on Ray Serve, one engine per replica.

Each replica asks for its roles' resources (`num_gpus` for CUDA, a custom resource for an NPU or Intel GPU,
`num_cpus` for CPU workers) and holds a batch plus `REPLICA_QUEUE`; up to `max_queued` more wait at the proxy,
beyond that 503 with Retry-After. Ray is imported lazily (the `cluster` extra). Limits: replicas pin cores by
their rank on the node (the only CPU-heavy work there); Serve counts `max_queued_requests` per proxy, loosely
under bursts; a group signal stops a local Ray at once, so the drain cannot reach the replicas; `/server` and
`/metrics` answer for one replica at a time. SIGTERM / Ctrl-C drains every replica, then stops Serve and Ray.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time

from mirror_rt.runtime.batch.decoder import BatchConfig
from mirror_rt.serving.proxy import APP, DEPLOYMENT, PAGE_VARIABLE, PROXY_CALLBACK
from mirror_rt.serving.replica import replica_deployment
from mirror_rt.serving.server import bind_or_say, configure_logging, log
from mirror_rt.serving.settings import ClusterConfig, ClusterError, ServerConfig

INSTALL = 'pip install "mirror-rt[cluster]"'
REPLICA_QUEUE = 1  # a replica holds a batch of generations running and this many ready to join
OBJECT_STORE = 256 * 2**20  # a local Ray's object store: requests and answers are small
# Device kinds that are Ray custom resources (named by us: Ray reserves "NPU" for Ascend chips).
CUSTOM_RESOURCES = {"npu": "intel_npu", "gpu": "intel_gpu", "qnn": "qnn_npu"}


def require_ray():
    """`ray` and `ray.serve`, or a one-line ClusterError naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ClusterError(f"serving replicas needs Ray Serve: {INSTALL}") from None
    return ray, serve


# --- what a replica asks for ----------------------------------------------------------------------


def replica_resources(mode: str | None, target_device: str, draft_device: str, threads: int | None = None) -> dict:
    """`ray_actor_options` for one replica: a GPU for CUDA, a custom resource for an NPU or Intel GPU, a CPU per
    thread of each CPU worker (Mirror runs two workers at once; ar and sd one; mode None: the engine's default)."""
    from mirror_rt.devices.placement import runs_mirror
    from mirror_rt.devices.registry import parse_device

    roles = [target_device] if mode == "ar" else [target_device, draft_device]
    gpus, resources, cpu_roles = 0, {}, 0
    for text in roles:
        spec = parse_device(text)
        if spec.device == "cuda":
            if spec.index is not None:
                raise ClusterError(f"with replicas, name the CUDA device without an index ('{text}' -> 'cuda'): "
                                   "Ray gives each replica its own GPU")
            gpus = 1  # both roles on CUDA share the replica's one GPU
        elif spec.device.lower() in CUSTOM_RESOURCES:
            resources[CUSTOM_RESOURCES[spec.device.lower()]] = 1
        else:
            cpu_roles += 1
    workers = cpu_roles if runs_mirror(mode) else min(cpu_roles, 1)
    options = {"num_cpus": workers * (threads or 1), "num_gpus": gpus}
    return {**options, "resources": resources} if resources else options


def deployment_options(cluster: ClusterConfig, server: ServerConfig) -> dict:
    """`serve.deployment` options: replicas or autoscaling, resources, limits, health, drain."""
    rows = cluster.batch_rows or BatchConfig().max_num_seqs
    options = dict(ray_actor_options=dict(cluster.actor_options),
                   max_ongoing_requests=rows + REPLICA_QUEUE,  # a full batch, and requests ready to join it
                   max_queued_requests=server.max_queued,
                   backpressure_config={"retry_after_s": server.retry_after_s},
                   health_check_period_s=cluster.health_check_period_s,
                   graceful_shutdown_timeout_s=server.drain_timeout,
                   max_constructor_retry_count=1)  # an engine that fails to load fails again: report it
    if not cluster.autoscaling:
        return {**options, "num_replicas": cluster.replicas}
    low = cluster.min_replicas if cluster.min_replicas is not None else 1
    high = cluster.max_replicas if cluster.max_replicas is not None else max(low, cluster.replicas)
    scaling = {"min_replicas": low, "max_replicas": high, "initial_replicas": min(max(cluster.replicas, low), high),
               "target_ongoing_requests": cluster.target_ongoing_requests or 1}
    return {**options, "autoscaling_config": scaling}


def build(settings: ServerConfig, cluster: ClusterConfig, load):
    """The Serve application: `load()` runs in each replica to build its engine."""
    require_ray()
    return replica_deployment(deployment_options(cluster, settings)).bind(settings, load, REPLICA_QUEUE)


# --- a Ray to run on --------------------------------------------------------------------------------


def start(cluster: ClusterConfig, server: ServerConfig, custom_resources: dict | None = None) -> bool:
    """Start a local Ray (True) or join `cluster.ray_address` (False), then Serve on the server's address."""
    ray, _ = require_ray()
    local = cluster.ray_address is None
    if local:
        ray.init(resources=custom_resources or {}, include_dashboard=False, object_store_memory=OBJECT_STORE,
                 _metrics_export_port=cluster.metrics_export_port)
    else:
        ray.init(address=cluster.ray_address)
        _refuse_a_second_app()
    start_serve(cluster, server)
    return local


def _refuse_a_second_app() -> None:
    """A ClusterError when the cluster joined already runs our app: deploying would take it over."""
    _, serve = require_ray()
    try:
        running = APP in serve.status().applications
    except Exception:  # noqa: BLE001 -- no Serve on that cluster yet (Ray's error type varies by version)
        running = False
    if running:
        raise ClusterError(f"this Ray cluster already serves mirror-rt (Serve app '{APP}'): stop that server first "
                           "(one per cluster: Serve has one HTTP proxy per node, on the first server's port)")


def start_serve(cluster: ClusterConfig, server: ServerConfig) -> None:
    """Serve on the connected Ray: proxies through `serving.proxy`, a replica unplaced for `placement_timeout` s
    reported, one failing its health check stopped at once (its engine is dead); only when this call starts Serve."""
    _, serve = require_ray()
    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK,
           "RAY_SERVE_SLOW_STARTUP_WARNING_S": str(cluster.placement_timeout),
           "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": str(cluster.placement_timeout),
           "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1", PAGE_VARIABLE: "1" if server.ui else "0"}
    serve.start(http_options={"host": server.host, "port": server.port},
                controller_options={"runtime_env": {"env_vars": env}})


def local_resources(actor_options: dict) -> dict:
    """The custom resources a local Ray should declare: those the replicas ask for that this machine has."""
    from mirror_rt.devices.registry import available_devices

    wanted = actor_options.get("resources", {})
    if not wanted:
        return {}
    found = available_devices()
    have = {"intel_npu": any(d.startswith("NPU") for d in found.get("openvino", [])),
            "intel_gpu": any(d.startswith("GPU") for d in found.get("openvino", [])),
            "qnn_npu": "qnn" in found.get("onnxruntime", [])}
    return {name: 1 for name in wanted if have.get(name)}


def check_fits(actor_options: dict, replicas: int) -> None:
    """On a local Ray (nothing will join it): a ClusterError at once when `replicas` cannot all be placed."""
    import ray

    need = {"CPU": actor_options.get("num_cpus", 1), "GPU": actor_options.get("num_gpus", 0),
            **actor_options.get("resources", {})}
    need = {name: amount for name, amount in need.items() if amount}
    room = 0
    for node in ray.nodes():
        if node.get("Alive"):
            have = node.get("Resources", {})
            room += min((math.floor(have.get(name, 0) / amount) for name, amount in need.items()), default=replicas)
    if room < replicas:
        offered = {name: ray.cluster_resources().get(name, 0) for name in need}
        raise ClusterError(f"cannot place {replicas} replicas: each needs {need}, this machine offers {offered} "
                           f"(room for {room})")


# --- deploy, wait, serve until a signal ------------------------------------------------------------


def deploy(app, name: str = APP, route_prefix: str = "/") -> None:
    """Deploy and wait until every replica serves; a ClusterError (one line) when that cannot happen."""
    _, serve = require_ray()
    serve.run_many([serve.RunTarget(target=app, name=name, route_prefix=route_prefix)],
                   wait_for_applications_running=False)
    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return
        deployment = status.deployments.get(DEPLOYMENT) if status is not None else None
        message = deployment.message if deployment is not None else ""
        if status is not None and status.status == "DEPLOY_FAILED":
            raise ClusterError(f"the replicas failed to start: {_last_line(message or status.message)}")
        if "to be scheduled" in message:
            raise ClusterError(f"a replica cannot be placed: {_last_line(message)}")
        time.sleep(0.2)


def _last_line(message: str) -> str:
    """The line that says what went wrong (Serve's messages end with the exception)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no reason given"


def stop(local: bool, drain: bool = True) -> None:
    """Take the app (and a local Ray) down, the replicas draining first unless `drain` is False."""
    import ray
    from ray import serve

    if local:
        try:
            if drain:
                serve.shutdown()
        finally:
            ray.shutdown()
    else:
        serve.delete(APP, _blocking=drain)


def metrics_url() -> str | None:
    """Where the local Ray serves the metrics of its replicas (Prometheus text); None on a cluster."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]
    if len(nodes) != 1:
        return None
    return f"http://{nodes[0]['NodeManagerAddress']}:{nodes[0]['MetricsExportPort']}/metrics"


def serve_replicas(settings: ServerConfig, cluster: ClusterConfig, load) -> int:
    """Serve on replicas until SIGTERM / Ctrl-C, then drain and take them down; returns the exit code.
    A signal while deploying takes down what started; a second one while draining stops at once."""
    configure_logging()
    if settings.max_queued < 1:  # Serve's max_queued_requests: -1 (no limit) or positive
        raise ClusterError("--max-queued 0 needs a single engine: with replicas, Ray Serve's proxy queues at least "
                           "one request (use --max-queued 1 or more)")
    if cluster.ray_address is None:  # the proxy will listen here: a port in use is one line, not Ray's traceback
        sock, refused = bind_or_say(settings.host, settings.port)
        if refused:
            print(refused, file=sys.stderr)
            return 1
        sock.close()
    local = start(cluster, settings, local_resources(cluster.actor_options) if cluster.ray_address is None else None)
    # after ray.init installs its own; SIGINT too: a background process inherits it ignored
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            options = deployment_options(cluster, settings)
            if local:
                initial = options.get("autoscaling_config", {}).get("initial_replicas", cluster.replicas)
                check_fits(cluster.actor_options, initial)
            deploy(build(settings, cluster, load))
        except BaseException:
            stop(local, drain=False)
            raise
        log.info(describe(settings, cluster, options))
        with contextlib.suppress(KeyboardInterrupt):  # until SIGTERM / Ctrl-C
            while True:
                time.sleep(3600)
        log.info("draining: no new requests; up to %g s for the admitted ones", settings.drain_timeout)
        try:
            drained = drain(settings.drain_timeout)
        except KeyboardInterrupt:  # a second signal: stop at once
            drained = False
        stop(local, drain=drained)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    log.info("stopped")
    return 0


def drain(timeout: float) -> bool:
    """Drain every replica as the single server does, the proxies still up to pass on what they send;
    False when it could not be (then stop at once)."""
    _, serve = require_ray()
    try:
        handle = serve.get_deployment_handle(DEPLOYMENT, APP)
        handle.broadcast("drain", timeout).results(timeout_s=timeout + 15, return_exceptions=True)
    except (RuntimeError, TimeoutError, ValueError) as exc:
        log.warning("the replicas could not drain: %s", exc)
        return False
    time.sleep(0.5)  # the proxies pass on the last events
    return True


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (and SIGINT, even where inherited as ignored) stop as Ctrl-C does


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def describe(settings: ServerConfig, cluster: ClusterConfig, options: dict) -> str:
    """The start-up line: where, how many replicas, what each asks for, and where the metrics are."""
    scaling, count = options.get("autoscaling_config"), _replicas(cluster.replicas)
    if scaling:
        count = (f"{_replicas(scaling['initial_replicas'])} (autoscaling {scaling['min_replicas']}.."
                 f"{scaling['max_replicas']}, target {scaling['target_ongoing_requests']:g} ongoing each)")
    metrics = metrics_url() or "each Ray node's metrics export port"
    key = "API key required" if settings.api_key else "no API key"
    mode = settings.defaults.mode or "the engine's default"
    return (f"serving {count} at http://{settings.host}:{settings.port}/v1 (Ray Serve), mode {mode}; "
            f"each replica asks for {cluster.actor_options}; {key}; queue {settings.max_queued} at the proxy; "
            f"metrics of every replica: {metrics}")
