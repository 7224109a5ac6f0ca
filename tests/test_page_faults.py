"""The playground page when things go wrong or differ from the plain case, in headless Chromium against a real
server: a file of the page that does not load is said in a line (not "connecting…" forever); behind replicas the
server tab names the replica that answered; an answer the load policy decoded without speculating says so and why,
beside the Mode menu too (and so does "Compare with ar"); the prompt stays after any error; a lost connection is
said as such."""

from __future__ import annotations

import dataclasses
import re

import pytest
from browser_support import expect
from serve_support import RunningServer, tiny_engine

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server():
    """The tiny engine whose load policy finds target-only faster at every batch size (as it can at a high load,
    or for a small model: runtime.batch.policy), its responses named as a replica's."""
    from mirror_rt.runtime.batch.policy import AR, SpeculationPolicy
    from mirror_rt.serving.app import ServerConfig, create_app
    from mirror_rt.serving.replica import ReplicaHeader

    class TargetOnlyWins(SpeculationPolicy):
        def choose(self, batch: int, ways: tuple = ()) -> str:
            return AR

    engine = tiny_engine()
    engine.batch = dataclasses.replace(engine.batch, adaptive_speculation=True)
    engine.reset()
    engine.decoder.policy = TargetOnlyWins(adaptive=True)
    app = create_app(ServerConfig(), lambda: engine)
    app.add_middleware(ReplicaHeader, replica="replica-7")
    running = RunningServer(app).wait_ready()
    yield running
    running.stop()


@pytest.mark.parametrize("file", ["server.js", "page.css"])
def test_a_file_of_the_page_that_does_not_load_is_said(browser, server, file):
    """In a banner the page's modules leave alone: a stylesheet that failed left them running, and they cleared the
    status line, so nothing was said (the page lost its token colours without a word)."""
    context = browser.new_context()
    context.route(f"**/ui/{file}", lambda route: route.fulfill(status=503, body="busy"))
    page = context.new_page()
    try:
        page.goto(server.url + "/")
        if file.endswith(".js"):
            expect(page.locator("#model")).to_have_text("page not loaded")
            expect(page.locator("#status")).to_contain_text("did not load")
        else:
            expect(page.locator("#model")).to_have_text("tiny")  # the modules ran
        named = "/ui/main.js, or one it imports" if file.endswith(".js") else "/ui/page.css"  # a module's import
        expect(page.locator(".load-error")).to_contain_text(f"did not load ({named}")
    finally:
        context.close()


def test_the_server_tab_names_the_replica_that_answered(page):
    expect(page.page.locator("#model")).to_have_text("tiny")
    page.page.click("#tab-server")
    expect(page.page.locator("#srv-replica")).to_contain_text("replica-7")


def test_an_answer_decoded_without_speculating_says_why(page):
    import httpx

    answer = httpx.post(page.page.url + "v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "mode": "mirror", "temperature": 0})
    assert answer.json()["mirror_rt"]["speculative_steps"] == 0  # the premise: the policy chose target-only
    expect(page.page.locator("#model")).to_have_text("tiny")
    page.ask("hi", mode="mirror", max_tokens=8, temperature=0)
    page.wait_done()
    note = page.page.locator(".message.assistant .meta").last
    expect(note).to_contain_text("no speculation: ")  # the server's reasons, each with its steps
    expect(note).to_contain_text(re.compile(r"too few tokens were left .* \(\d+ steps\)"))
    ran = page.page.locator("#mode-ran")  # beside the Mode menu, which still says what was asked
    expect(ran).to_contain_text("Ran: target-only, not mirror: no speculation")
    assert page.page.input_value("#mode") == "mirror"
    page.page.click("#compare-button")
    expect(page.page.locator("#compare-summary")).to_contain_text("no speculation", timeout=60_000)


def test_the_prompt_stays_after_an_error(page):
    expect(page.page.locator("#model")).to_have_text("tiny")
    long = "x" * 400  # beyond the tiny model's context of 256: a 400
    page.ask(long, max_tokens=8)
    expect(page.page.locator("#status")).to_have_class(re.compile("error"))
    assert page.page.input_value("#prompt") == long


def test_a_lost_connection_is_said(page):
    expect(page.page.locator("#model")).to_have_text("tiny")
    page.page.route("**/v1/chat/completions", lambda route: route.abort("connectionreset"))
    page.ask("hello", max_tokens=8)
    expect(page.page.locator("#status")).to_contain_text("the connection to the server was lost")
    assert page.page.input_value("#prompt") == "hello"
