"""Who may drive the server, and the trace every refusal leaves (a real server on a free port, raw HTTP and raw
sockets where a client would hide what matters): another site's page cannot post to it (its Origin is refused,
so is a body that is not application/json), a DNS-rebound host name is refused, the page served by the server
itself keeps working, an allowed origin gets CORS; every response is counted by route and status code, and what
the HTTP layer refuses before the app comes back in the JSON envelope too."""

from __future__ import annotations

import socket

import httpx
import pytest
from serve_support import metric, scrape, start

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def allowing(engine):
    running = start(engine, allowed_origins=("http://localhost:3000",), allowed_hosts=("box.lan",))
    yield running
    running.stop()


def post(url: str, headers: dict, body: bytes | None = None) -> httpx.Response:
    import json

    return httpx.post(url + "/v1/chat/completions", content=body or json.dumps(BODY).encode(), headers=headers,
                      timeout=30)


def test_another_sites_post_is_refused_and_generates_nothing(server):
    """curl -H 'Origin: http://evil.example' -H 'Content-Type: text/plain' -d '{...valid...}' answered 200."""
    before = metric(scrape(server.url), "generation_tokens_total")
    for headers in ({"origin": EVIL, "content-type": "text/plain"},
                    {"origin": EVIL, "content-type": "application/json"},
                    {"origin": "null", "content-type": "application/json"}):  # a sandboxed frame or a file:// page
        refused = post(server.url, headers)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["type"] == "PermissionDeniedError" and "--allowed-origins" in error["message"]
        assert "access-control-allow-origin" not in refused.headers
    assert metric(scrape(server.url), "generation_tokens_total") == before


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", None])
def test_a_body_that_is_not_json_is_a_415(server, kind):
    """What a browser sends without a CORS preflight, or no type at all: 415, even from no origin."""
    refused = post(server.url, {"content-type": kind} if kind else {})
    assert refused.status_code == 415 and refused.json()["error"]["code"] == 415
    assert "application/json" in refused.json()["error"]["message"]


def test_the_servers_own_page_and_plain_clients_pass(server):
    """Same origin (the playground page: Origin equals the Host it posted to), no Origin (the official client)."""
    own = post(server.url, {"origin": server.url, "content-type": "application/json; charset=utf-8"})
    assert own.status_code == 200, own.text
    answer = server.client().chat.completions.create(model="tiny", **BODY)
    assert answer.choices[0].message.content is not None


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io"])
def test_a_rebound_host_name_is_refused(server, host):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example, and its
    Origin equals it, so the origin check alone lets it read answers. The host check refuses it, every route."""
    for path in ("/v1/models", "/metrics", "/health"):
        refused = httpx.get(server.url + path, headers={"host": host, "origin": f"http://{host}"}, timeout=10)
        assert refused.status_code == 403, (path, refused.text)
        assert "--allowed-hosts" in refused.json()["error"]["message"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "app.localhost", "127.0.0.1", "[::1]:80", "10.1.2.3"])
def test_local_names_and_ip_addresses_pass(server, host):
    assert httpx.get(server.url + "/health", headers={"host": host}, timeout=10).status_code == 200


def test_an_allowed_origin_gets_cors_and_its_preflight(allowing):
    origin = "http://localhost:3000"
    preflight = httpx.options(allowing.url + "/v1/chat/completions", timeout=10, headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "x-stainless-os" in preflight.headers["access-control-allow-headers"]
    answer = post(allowing.url, {"origin": origin, "content-type": "application/json"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    assert post(allowing.url, {"origin": EVIL, "content-type": "application/json"}).status_code == 403
    assert httpx.get(allowing.url + "/health", headers={"host": "box.lan:8000"}, timeout=10).status_code == 200
    assert httpx.get(allowing.url + "/health", headers={"host": "evil.example"}, timeout=10).status_code == 403


def raw(url: str, request: bytes) -> bytes:
    """What the server sends back for bytes written on a socket, up to its close."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Bad: a\x01b\r\n\r\n",  # a header with control bytes
    b"GET /health HTTP/1.1\r\nHost: localhost\r\nBad Name: x\r\n\r\n",
    b"NOT HTTP AT ALL\r\n\r\n"], ids=["control bytes", "space in a name", "no request line"])
def test_the_http_layers_own_errors_come_in_the_envelope_and_are_counted(server, request_bytes):
    """uvicorn answered these in plain text ("Invalid HTTP request received.") and nothing counted them."""
    import json

    before = metric(scrape(server.url), "http_requests_total", handler="none", method="none", status="400")
    head, _, body = raw(server.url, request_bytes).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and "invalid HTTP request" in error["message"]
    after = metric(scrape(server.url), "http_requests_total", handler="none", method="none", status="400")
    assert after == before + 1


def test_responses_are_counted_by_route_and_status(server):
    """The 4xx answers appeared nowhere in /metrics; now each response is counted, streams when they end."""
    def count(handler, status, method="POST"):
        return metric(scrape(server.url), "http_requests_total", handler=handler, method=method, status=str(status))

    route = "/v1/chat/completions"
    before = {(route, 200): count(route, 200), (route, 400): count(route, 400), (route, 404): count(route, 404),
              ("none", 404): count("none", 404, "GET"), ("/v1/models", 200): count("/v1/models", 200, "GET")}
    client = server.client()
    client.chat.completions.create(model="tiny", **BODY)
    list(client.chat.completions.create(model="tiny", stream=True, **BODY))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", **BODY)
    client.models.list()
    assert httpx.get(server.url + "/no/such/route", timeout=10).status_code == 404
    assert count(route, 200) - before[(route, 200)] == 2
    assert count(route, 400) - before[(route, 400)] == 1 and count(route, 404) - before[(route, 404)] == 1
    assert count("none", 404, "GET") - before[("none", 404)] == 1  # an unknown path: no route, no new label
    assert count("/v1/models", 200, "GET") - before[("/v1/models", 200)] == 1
