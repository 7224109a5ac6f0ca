"""The server's settings, each default written once: one server (`ServerConfig`) and its replicas (`ClusterConfig`).

Each field is named as its `mirror-rt serve` flag, which reads its default here; requests that name none get
`defaults` (a `GenerationConfig`). Imports no web framework: the CLI builds these without the `serve` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirror_rt.runtime.config import GenerationConfig


class ClusterError(ValueError):
    """The cluster cannot serve as asked (no Ray, a replica that cannot be placed, a failed deploy)."""


@dataclass(frozen=True)
class ServerConfig:
    """What the server adds to an engine."""

    host: str = "127.0.0.1"  # address to listen on (with replicas: Serve's proxies)
    port: int = 8000
    served_model_name: str | None = None  # None: the engine's model name
    api_key: str | None = None  # guards /v1/* when set
    max_queued: int = 16  # requests waiting beyond those running (with replicas: at the proxy); 503 beyond
    request_timeout: float | None = None  # seconds a request may take (queue included), then an error
    drain_timeout: float = 30.0  # on SIGTERM / Ctrl-C: seconds admitted requests may take to finish
    defaults: GenerationConfig = field(default_factory=GenerationConfig)  # mode, gamma... of requests naming none
    temperature: float = 1.0  # OpenAI's default when a request names none
    retry_after_s: int = 1  # Retry-After of a 503 (the proxy's too)
    # a replica ends its process when its engine thread dies (the proxy resends); a single server answers 503
    exit_on_engine_death: bool = False
    ui: bool = True  # the playground page at / (serve --no-ui: off, / answers 404)
    # browser origins allowed beside the server's own page ("*": any), e.g. ("http://localhost:3000",)
    allowed_origins: tuple[str, ...] = ()
    # Host names answered beside localhost and IP addresses ("*": any); empty: see serving.guard
    allowed_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterConfig:
    """How the app is spread over Ray Serve replicas (the server's own settings: `ServerConfig`)."""

    replicas: int = 1  # replicas to run (the initial count when autoscaling)
    ray_address: str | None = None  # None: start a local Ray; "auto" or "ray://host:port": join that cluster
    min_replicas: int | None = None  # any of these three set: Serve's autoscaling_config
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target per replica (None: 1, one stream each)
    batch_rows: int | None = None  # sequences a replica decodes at once (its --max-num-seqs); None: the default
    actor_options: dict = field(default_factory=lambda: {"num_cpus": 1})  # per replica (`replica_resources`)
    placement_timeout: int = 60  # seconds a replica may stay unplaced before it is an error (when we start Serve)
    health_check_period_s: float = 10.0
    metrics_export_port: int | None = None  # local Ray: where it serves every replica's metrics

    def __post_init__(self):
        if self.replicas < 1:
            raise ClusterError(f"replicas must be >= 1, got {self.replicas}")
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is not None and low > high:
            raise ClusterError(f"--min-replicas {low} is more than --max-replicas {high}")

    @property
    def autoscaling(self) -> bool:
        return (self.min_replicas, self.max_replicas, self.target_ongoing_requests) != (None, None, None)
