"""The playground's server side: token origins over SSE only when asked (OpenAI clients see nothing new),
`GET /server` (load, totals, recent requests from the server's own metrics, behind the key), the page's
files at `/` and `/ui/*` (shipped as package data) and `--no-ui`."""

from __future__ import annotations

import json
import re
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest
from serve_support import start

pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "hello there"}]


def stream(server, **options) -> list[dict]:
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "stream": True, **options}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def content_chunks(chunks: list[dict]) -> list[dict]:
    return [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]


@pytest.mark.parametrize("options", [{}, {"stream_options": {"include_usage": True}},
                                     {"stream_options": {"include_origins": False}}])
def test_chunks_are_unchanged_without_the_option(server, options):
    chunks = content_chunks(stream(server, mode="mirror", **options))
    assert chunks and all(set(c) == {"id", "object", "created", "model", "choices"} for c in chunks)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_origins_describe_every_token_of_a_greedy_answer(server, reference, mode):
    chunks = stream(server, mode=mode, stream_options={"include_origins": True})
    entries = []
    for chunk in content_chunks(chunks):
        tokens = chunk["mirror_rt"]["tokens"]
        assert "".join(e["text"] for e in tokens) == chunk["choices"][0]["delta"]["content"]
        entries += tokens
    expected = reference.generate(MESSAGES, mode="ar", max_new_tokens=40)
    assert [e["token"] for e in entries if e["token"] is not None] == expected.tokens  # lossless, token by token
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    origins = [e["origin"] for e in entries if e["token"] is not None]
    assert origins.count("draft") == final["timings"]["draft_n_accepted"]
    assert {"draft", "correction"} <= set(origins) <= {"draft", "correction", "bonus", "target"}
    windows = {}
    for e in (e for e in entries if e["token"] is not None):
        windows.setdefault(e["window"], []).append(e)
    assert sorted(windows) == list(range(len(windows)))  # the prompt's first token is window 0, then each step
    for index, window in windows.items():
        assert [e["position"] for e in window] == list(range(len(window)))
        accepted = sum(e["origin"] == "draft" for e in window)
        assert accepted <= window[0]["drafted"] and [e["origin"] for e in window[:accepted]] == ["draft"] * accepted
        last = "target" if window[0]["drafted"] == 0 else "bonus" if accepted == window[0]["drafted"] else "correction"
        assert window[-1]["origin"] == last or index == max(windows)  # the last window may be cut by the end


def test_origins_count_the_tokens_usage_counts_the_end_included(server):
    """An answer that ends with the end-of-sequence token (a schema's answer ends there): its entry comes last, with
    `end: true`, so the entries add up to usage.completion_tokens (the page said "8 tokens" beside a legend of 7)."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["yes", "no"]}}}
    chunks = stream(server, max_tokens=20, mode="mirror", response_format=schema,
                    stream_options={"include_usage": True, "include_origins": True})
    entries = [e for c in chunks if c.get("mirror_rt") and "tokens" in c["mirror_rt"] for e in c["mirror_rt"]["tokens"]]
    usage = chunks[-1]["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert len([e for e in entries if e["token"] is not None]) == usage["completion_tokens"]
    assert entries[-1]["end"] is True and entries[-1]["text"] == "" and not any(e.get("end") for e in entries[:-1])


def test_ar_tokens_are_all_the_targets(server):
    chunks = stream(server, mode="ar", stream_options={"include_origins": True})
    entries = [e for c in content_chunks(chunks) for e in c["mirror_rt"]["tokens"] if e["token"] is not None]
    assert entries and {e["origin"] for e in entries} == {"target"} and {e["position"] for e in entries} == {0}


def test_origins_are_a_streaming_option(server):
    """stream_options without stream is a 400 (vLLM's rule), origins included."""
    body = {"messages": MESSAGES, "max_tokens": 8, "stream_options": {"include_origins": True}}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream_options"


def test_server_lists_recent_requests_from_its_metrics(server):
    chunks = stream(server, mode="mirror", max_tokens=12)
    status = httpx.get(server.url + "/server", timeout=10).json()
    assert status["model"] == "tiny" and status["status"] == "ready" and status["mode"] == "mirror"
    assert (status["running"], status["waiting"], status["max_queued"]) == (0, 0, 4)
    assert status["roles"]["target"] == {"device": "torch:cpu", "precision": "fp64"}
    newest = status["recent"][0]
    assert newest["id"] == chunks[0]["id"] and newest["mode"] == "mirror" and newest["completion_tokens"] == 12
    assert newest["tokens_per_s"] > 0 and 1 <= newest["mean_accepted_length"] and 0 <= newest["acceptance"] <= 1
    assert sum(status["requests"].values()) >= len(status["recent"]) >= 1
    assert status["generation_tokens"] >= 12 and status["accepted_tokens"] <= status["draft_tokens"]
    kv = status["kv_cache"]  # the budget and what the prefix cache holds of it
    assert kv["budget_bytes"] > 0 and 0 < kv["usage"] <= 1 and 0 < kv["prefix_cache_bytes"] <= kv["budget_bytes"] / 2


def test_page_files_are_served_with_a_strict_policy(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assets = re.findall(r'(?:src|href)="/ui/([^"]+)"', page.text)
    imports = {m for js in Path(ROOT / "serving/ui").glob("*.js") for m in re.findall(r'from "\./([^"]+)"',
                                                                                       js.read_text())}
    assert "main.js" in assets and "page.css" in assets
    for name in set(assets) | imports:
        response = httpx.get(f"{server.url}/ui/{name}")
        assert response.status_code == 200, name
    assert httpx.get(server.url + "/ui/app.py").status_code == 404
    assert httpx.get(server.url + "/ui/..%2Fapp.py").status_code == 404


def test_key_guards_the_data_not_the_page(engine):
    guarded = start(engine, api_key="s3cret")
    try:
        assert httpx.get(guarded.url + "/").status_code == 200
        assert httpx.get(guarded.url + "/ui/main.js").status_code == 200
        refused = httpx.get(guarded.url + "/server")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
        ok = httpx.get(guarded.url + "/server", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["running"] == 0
    finally:
        guarded.stop()


def test_no_ui_answers_404(engine):
    plain = start(engine, ui=False)
    try:
        for path in ("/", "/ui/main.js"):
            response = httpx.get(plain.url + path)
            assert response.status_code == 404 and response.json()["error"]["code"] == 404
        assert httpx.get(plain.url + "/server").status_code == 200
    finally:
        plain.stop()


def test_serve_no_ui_flag():
    from mirror_rt.cli import build_parser

    assert build_parser().parse_args(["serve"]).ui is True
    assert build_parser().parse_args(["serve", "--no-ui"]).ui is False


def test_every_page_file_is_package_data():
    """A non-editable install ships exactly what pyproject's package-data names: every file of serving/ui."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["mirror_rt.serving"]
    files = [p.relative_to(ROOT / "serving").as_posix() for p in (ROOT / "serving/ui").iterdir()]
    assert "ui/index.html" in files
    assert all(any(fnmatch(f, pattern) for pattern in shipped) for f in files)


def test_origin_trail_credits_held_back_text_to_the_token_that_releases_it():
    """Entries are made between pieces: tokens whose text was held back get "", the releasing token carries it,
    and text released by no token (the end of the generation) comes with token null."""
    from types import SimpleNamespace

    from mirror_rt.runtime.generation import Step
    from mirror_rt.serving.origins import OriginTrail

    gen = SimpleNamespace(tokens=[], steps=[Step(0.0, 1), Step(0.1, 3, drafted=2, accepted=2)])
    trail = OriginTrail()
    gen.tokens += [10]
    first = trail.entries(gen, "A")
    gen.tokens += [11, 12]  # 11's text held back (a split character), released with 12's
    second = trail.entries(gen, "bc")
    last = trail.entries(gen, "!")  # the final flush: no new token
    assert first == [{"token": 10, "text": "A", "origin": "target", "window": 0, "position": 0, "drafted": 0}]
    assert [(e["token"], e["text"], e["origin"], e["window"], e["position"]) for e in second] == [
        (11, "", "draft", 1, 0), (12, "bc", "draft", 1, 1)]
    assert last == [{"token": None, "text": "!", "origin": None, "window": None, "position": None, "drafted": None}]


def test_forced_tokens_are_marked_alike_in_every_mode(server):
    """Under a schema, tokens the grammar allows alone (keys, separators) are `forced`: a property of the text
    and the grammar, so every mode marks the same positions; without a grammar nothing is forced."""
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 12},
                                               "count": {"type": "integer"}},
              "required": ["greeting", "count"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "g", "schema": schema}}
    marked = {}
    for mode in ("ar", "sd", "mirror"):
        chunks = stream(server, mode=mode, response_format=fmt, stream_options={"include_origins": True})
        entries = [e for c in content_chunks(chunks) for e in c["mirror_rt"]["tokens"] if e["token"] is not None]
        marked[mode] = [(e["token"], e["origin"] == "forced") for e in entries]
        assert any(e["origin"] == "forced" for e in entries), mode
    assert marked["sd"] == marked["ar"] == marked["mirror"]
    plain = stream(server, mode="mirror", stream_options={"include_origins": True})
    assert all(e["origin"] != "forced" for c in content_chunks(plain) for e in c["mirror_rt"]["tokens"])
