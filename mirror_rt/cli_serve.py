"""`mirror-rt serve`: the parser and the command (the server is mirror_rt.serving; replicas: `cli_replicas`).

`serve` takes `run`'s engine and decoding options (the decoding ones are the defaults of requests that
name none) and the server's, each flag a `ServerSettings` field of the same name with its default read
there. `ray_serve_app` builds the same app for a RayService (KubeRay) from `serve` options.
"""

from __future__ import annotations

from mirror_rt.cli_args import count, port_number, positive_number
from mirror_rt.cli_options import (
    ENGINE_HELP,
    add_decoding_options,
    add_engine_options,
    engine_options,
    generation_config,
)
from mirror_rt.cli_replicas import add_replica_options, cluster_settings, serve_on_ray, wants_ray
from mirror_rt.serving.settings import ServerSettings

SERVER = ServerSettings()  # the server's defaults, read by its flags


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
        return serve_on_ray(args, settings, load, torch_engine(args))
    return serve(settings, load)


def serve_parts(args):
    """`serve`'s ServerSettings and the function that loads its engine (in a replica, with replicas)."""
    import os
    from dataclasses import fields

    from mirror_rt.devices.engines import load_engine

    defaults = generation_config(args)
    given = {f.name: getattr(args, f.name) for f in fields(ServerSettings) if hasattr(args, f.name)}
    settings = ServerSettings(**given | {"api_key": args.api_key or os.environ.get("MIRROR_RT_API_KEY") or None,
                                         "defaults": defaults})
    options = engine_options(args)

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
    return build(settings, cluster_settings(parsed, torch_engine(parsed)), load)


def torch_engine(args) -> bool:
    """Whether `load_engine` runs torch eager for these options (else a bundle, the default one included)."""
    options = engine_options(args)
    return options.models.bundle is None and (options.models.torch or bool(options.torch_asked()))
