"""bench-serve's first look at the server (evaluation.server_ready): it waits while a server starts (connection
refused, 503 while loading) and says in one line, at once, what cannot be benchmarked (a wrong URL, a refusal)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mirror_rt.evaluation.server_ready import ServerError, wait_until_ready


class Scripted(BaseHTTPRequestHandler):
    """Answers GET /v1/models with the next (status, body) of the server's script, then the last one for good."""

    def do_GET(self):
        script = self.server.script
        status, body = script.pop(0) if len(script) > 1 else script[0]
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    servers = []

    def start(*script):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
        server.script, server.seen = list(script), []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


LOADING = (503, {"error": {"message": "the model is still loading", "type": "unavailable_error"}})
READY = (200, {"object": "list", "data": [{"id": "m", "object": "model"}]})


def test_a_loading_server_is_waited_for_with_one_line(scripted):
    server, url = scripted(LOADING, LOADING, READY)
    lines = []
    wait_until_ready(url, "k", timeout=10, log=lines.append, poll=0.05)
    assert [path for path, _ in server.seen] == ["/v1/models"] * 3
    assert server.seen[0][1] == "Bearer k"
    assert lines == [f"bench-serve: waiting up to 10 s for the server at {url} (503 the model is still loading)"]


def test_a_server_never_ready_ends_in_one_line(scripted):
    _, url = scripted(LOADING)
    with pytest.raises(ServerError, match=r"was not ready within 0.3 s \(last: 503 the model is still loading\)"):
        wait_until_ready(url, None, timeout=0.3, log=lambda line: None, poll=0.05)


@pytest.mark.parametrize("answer, said", [
    ((401, {"error": {"message": "invalid API key", "type": "authentication_error"}}), "answered 401 invalid API key"),
    ((404, "<html><body>File not found</body></html>"), "answered 404 Not Found (not an OpenAI-compatible server"),
    ((500, {"error": "boom"}), "answered 500 boom"),
])
def test_a_refusal_is_said_at_once(scripted, answer, said):
    server, url = scripted(answer)
    with pytest.raises(ServerError, match=said.replace("(", r"\(")):
        wait_until_ready(url, None, timeout=30, log=lambda line: None, poll=0.05)
    assert len(server.seen) == 1


def test_bench_serve_on_no_server_is_one_line_before_any_peer_loads(tmp_path, capsys):
    from mirror_rt.cli import main

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n")
    for url, said in [("http://127.0.0.1:9", "was not ready within 0.5 s (last: ConnectError"),
                      ("127.0.0.1:9", "cannot reach 127.0.0.1:9/v1/models: UnsupportedProtocol")]:
        code = main(["bench-serve", "--url", url, "--data", str(data), "--ready-timeout", "0.5",
                     "--peers", "mirror-rt-engine"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and said in err[-1] and err[-1].startswith("mirror-rt: error: ")
        assert not any("Traceback" in line for line in err)


def test_a_server_gone_mid_run_ends_the_run_in_one_line(scripted):
    """Every request of a level failed to connect: the run stops there and says so (it went on through every
    level, each '0 done, N failed')."""
    import asyncio

    from mirror_rt.evaluation.serve_bench import run_level

    server, url = scripted(READY)
    server.shutdown()
    server.server_close()  # nothing listens any more

    from openai import AsyncOpenAI

    from mirror_rt.evaluation import serve_bench

    async def gone():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)
        results, _ = await run_level(client, "m", [[{"role": "user", "content": "hi"}]], 4, 1)
        return results

    results = asyncio.run(gone())
    assert results[0].status == 0 and "APIConnectionError" in results[0].error
    assert serve_bench.summarize(results, 1.0, 1)["failure"].startswith("APIConnectionError")
