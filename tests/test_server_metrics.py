"""The server's Prometheus metrics before any request: every series is there, at 0 (as vLLM's), so dashboards
show 0 rather than "no data" and rate() counts the first request's tokens."""

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mirror_rt.serving.metrics import PREFIX, ServerMetrics  # noqa: E402


def test_every_family_has_its_series_at_zero_before_the_first_request():
    text = ServerMetrics("m").render().decode()
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith(PREFIX)]
    assert len(families) > 20
    later = ("spec_decode_num_accepted_tokens_per_pos", "device_fallback", "http_requests")  # labels not known yet
    for family in families:
        assert family.samples or family.name.removeprefix(PREFIX) in later, f"{family.name} has no series"
        assert all(s.labels["model_name"] == "m" for s in family.samples)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    assert values[(PREFIX + "prompt_tokens_total", (("model_name", "m"),))] == 0
    assert values[(PREFIX + "request_rejected_total", (("model_name", "m"), ("reason", "queue_full")))] == 0
    assert values[(PREFIX + "time_to_first_token_seconds_count", (("model_name", "m"),))] == 0
    assert values[(PREFIX + "constrained_requests_total", (("kind", "tools"), ("model_name", "m")))] == 0
