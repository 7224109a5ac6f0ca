"""`mirror-rt serve`: the parser and the command (the server is mirror_rt.serving), replicas on Ray Serve included.

Each server flag is a `ServerConfig` (replicas: `ClusterConfig`) field of the same name, its default read there.
"""

from __future__ import annotations

from mirror_rt.cli.options import (
    ENGINE_HELP,
    add_decoding_options,
    add_engine_options,
    count,
    engine_config,
    generation_config,
    port_number,
    positive_int,
    positive_number,
)
from mirror_rt.serving.settings import ClusterConfig, ServerConfig

SERVER = ServerConfig()  # the server's defaults, read by its flags


def add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, "
                           "Prometheus /metrics)")
    add_engine_options(serve, tuple(ENGINE_HELP))
    add_decoding_options(serve)
    serve.add_argument("--host", default=SERVER.host, help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=port_number, default=SERVER.port, help="port (default %(default)s)")
    serve.add_argument("--api-key", default=SERVER.api_key, help="require 'Authorization: Bearer KEY' on /v1/* "
                       "(default: $MIRROR_RT_API_KEY; none when unset)")
    serve.add_argument("--max-queued", type=count, default=SERVER.max_queued,
                       help="requests waiting beyond the --max-num-seqs running; more are refused with 503 "
                       "(default %(default)s)")
    serve.add_argument("--request-timeout", type=positive_number, default=SERVER.request_timeout,
                       help="seconds a request may take, its wait in the queue included, before it is stopped "
                       "with an error (default: no limit)")
    serve.add_argument("--served-model-name", default=SERVER.served_model_name,
                       help="the model name clients send (default: the model's name)")
    serve.add_argument("--drain-timeout", type=positive_number, default=SERVER.drain_timeout,
                       help="on SIGTERM / Ctrl-C, seconds admitted requests may take to finish (default %(default)s)")
    serve.add_argument("--no-ui", dest="ui", action="store_false", help="no playground page at / (404 there)")
    serve.add_argument("--allowed-origins", type=names, default=SERVER.allowed_origins, metavar="ORIGINS",
                       help="browser origins that may call the server besides its own page, comma-separated "
                       "(http://localhost:3000; '*': any); others get 403 (default: none)")
    serve.add_argument("--allowed-hosts", type=names, default=SERVER.allowed_hosts, metavar="NAMES",
                       help="Host names the server answers to besides localhost and IP addresses, comma-separated "
                       "('*': any); others get 403, against DNS rebinding (default: none where --host is a loopback "
                       "address, every name where it listens beyond this machine)")
    add_replica_options(serve)


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list of origins or host names."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def cmd_serve(args) -> int:
    from mirror_rt.serving.server import serve

    settings, load = serve_parts(args)
    if wants_ray(args):
        from mirror_rt.serving.cluster import require_ray, serve_replicas

        require_ray()
        return serve_replicas(settings, cluster_config(args, torch_engine(args)), load)
    return serve(settings, load)


def serve_parts(args):
    """`serve`'s ServerConfig and the function that loads its engine (in a replica, with replicas)."""
    import os
    from dataclasses import fields

    from mirror_rt.devices.engines import load_engine

    defaults = generation_config(args)
    given = {f.name: getattr(args, f.name) for f in fields(ServerConfig) if hasattr(args, f.name)}
    settings = ServerConfig(**given | {"api_key": args.api_key or os.environ.get("MIRROR_RT_API_KEY") or None,
                                         "defaults": defaults})
    options = engine_config(args)

    def load():
        return load_engine(options, defaults.mode)

    return settings, load


def ray_serve_app(args: dict):
    """A Ray Serve application builder: `import_path: mirror_rt.cli:ray_serve_app` in a RayService's
    serveConfigV2 (KubeRay), with `args: {options: "<mirror-rt serve options>"}`; the replicas are the
    ones `mirror-rt serve --replicas` runs."""
    import shlex

    from mirror_rt.cli import build_parser
    from mirror_rt.serving.cluster import build

    parsed = build_parser().parse_args(["serve", *shlex.split(args.get("options", ""))])
    settings, load = serve_parts(parsed)
    return build(settings, cluster_config(parsed, torch_engine(parsed)), load)


def torch_engine(args) -> bool:
    """Whether `load_engine` runs torch eager for these options (else a bundle, the default one included)."""
    options = engine_config(args)
    return options.models.bundle is None and (options.models.torch or bool(options.torch_asked()))


CLUSTER = ClusterConfig()  # the replicas' defaults, read by their flags


def add_replica_options(serve) -> None:
    ray = serve.add_argument_group("replicas on Ray Serve (pip install \"mirror-rt[cluster]\")")
    ray.add_argument("--replicas", type=positive_int, help="run N engines on Ray Serve, each on its own devices, "
                     "behind its proxy (default: one process, no Ray); --max-queued then waits at the proxy")
    ray.add_argument("--ray-address", help="join a running Ray cluster (auto, ray://host:10001); default: start one")
    ray.add_argument("--min-replicas", type=count, help="autoscale between --min-replicas and --max-replicas")
    ray.add_argument("--max-replicas", type=positive_int)
    ray.add_argument("--target-ongoing-requests", type=positive_number, default=CLUSTER.target_ongoing_requests,
                     help="autoscaling: requests per replica to aim at (default 1: one stream each)")
    ray.add_argument("--placement-timeout", type=positive_int, default=CLUSTER.placement_timeout,
                     help="seconds a replica may wait for its resources before serve fails (default %(default)s)")
    ray.add_argument("--metrics-export-port", type=port_number,
                     help="local Ray: the port serving every replica's metrics (default: Ray picks one)")


def wants_ray(args) -> bool:
    """Whether `serve` was asked for replicas (any replica option given)."""
    autoscaling = (args.min_replicas, args.max_replicas, args.target_ongoing_requests) != (None, None, None)
    return args.replicas is not None or args.ray_address is not None or autoscaling


def cluster_config(args, torch_engine: bool) -> ClusterConfig:
    """The ClusterConfig of `serve`'s options (each flag its field; not given: the field's default); each
    replica asks for the devices its roles run on."""
    from dataclasses import fields

    from mirror_rt.serving.cluster import replica_resources

    target, draft = (args.device or "cpu", "cpu") if torch_engine else (args.target, args.draft)
    given = {f.name: getattr(args, f.name) for f in fields(ClusterConfig) if getattr(args, f.name, None) is not None}
    return ClusterConfig(**given, actor_options=replica_resources(args.mode, target, draft, args.threads),
                           batch_rows=args.max_num_seqs)
