"""`mirror-rt serve --replicas N`: the options that put the server on Ray Serve replicas, and the dispatch
(the work is in mirror_rt.serving.cluster; Ray is imported only when these options are used)."""

from __future__ import annotations

from mirror_rt.cli.options import count, port_number, positive_int, positive_number
from mirror_rt.serving.settings import ClusterConfig

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


def serve_on_ray(args, settings, load, torch_engine: bool) -> int:
    """`serve` on Ray Serve replicas, until SIGTERM / Ctrl-C."""
    from mirror_rt.serving.cluster import require_ray, serve_replicas

    require_ray()
    return serve_replicas(settings, cluster_config(args, torch_engine), load)
