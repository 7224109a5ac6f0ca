"""The playground page in a real browser (headless Chromium through Playwright) against a real server on a
free port: it loads cleanly, streams coloured origins (greedy Mirror shows accepted draft tokens and
corrections, and the text is the target's own), its figures move while the answer streams, Stop cancels
on the server, "Compare with ar" shows the same text twice, the key is asked for and kept, the server page
lists the requests, and it works from the keyboard at phone width."""

from __future__ import annotations

import re
import time

import pytest
from browser_support import Page, expect
from serve_support import Delayed, metric, scrape, start, tiny_engine, wait_for

pytest.importorskip("fastapi")

PROMPT = "hello there"


@pytest.fixture(scope="module")
def slow_engine():
    """The tiny engine with every target verification slowed (an answer takes long enough to watch and stop)."""
    engine = tiny_engine()
    engine.target = Delayed(engine.target, 0.02)
    return engine


@pytest.fixture(scope="module")
def server(slow_engine):
    running = start(slow_engine, max_queued=4)
    yield running
    running.stop()


def test_page_loads_without_console_errors(page):
    expect(page.page.locator("#model")).to_have_text("tiny")
    expect(page.page.locator("#fig-devices")).to_contain_text("torch:cpu · fp64")
    assert page.page.input_value("#mode") == "mirror" and page.page.input_value("#gamma") == "4"
    assert page.errors == []


def test_answer_streams_coloured_origins_and_the_figures_move(page, reference):
    expect(page.page.locator("#model")).to_have_text("tiny")
    page.ask(PROMPT, mode="mirror", temperature=0, max_tokens=60)
    seen = set()
    deadline = time.monotonic() + 60
    while not page.page.text_content("#status").startswith("done") and time.monotonic() < deadline:
        if page.page.text_content("#figures-state") == "(live)":
            seen.add(page.figure("tokens"))
        time.sleep(0.01)
    page.wait_done()
    assert len(seen - {"–"}) >= 3  # the token count moved at least three times while the answer streamed
    answer = page.answer()
    assert answer.locator(".o-draft").count() > 0 and answer.locator(".o-correction").count() > 0
    assert answer.text_content() == reference.generate([{"role": "user", "content": PROMPT}], mode="ar",
                                                       max_new_tokens=60).text
    assert page.figure("tokens") == "60" and page.page.text_content("#figures-state") == "(from the server)"
    assert float(page.figure("rate")) > 0 and re.fullmatch(r"\d+ ms", page.figure("ttft"))
    assert float(page.figure("mal")) > 1 and re.fullmatch(r"\d+%", page.figure("hidden"))
    # one bar per window position drafted: up to gamma 4 (the adaptive window may never reach 4 in 60 tokens)
    bars = page.page.locator("#fig-chart rect.bar-fill").count()
    label = page.page.locator("#fig-chart svg").get_attribute("aria-label")
    assert 1 <= bars <= 4 and re.findall(r"position (\d+)", label) == [str(j + 1) for j in range(bars)]
    counts = page.page.locator("#legend .count").all_text_contents()
    assert sum(map(int, counts)) == 60
    assert page.errors == []


def test_stop_cancels_the_generation_on_the_server(page, server):
    expect(page.page.locator("#model")).to_have_text("tiny")
    before = metric(scrape(server.url), "request_success_total", finished_reason="abort")
    page.ask(PROMPT, mode="mirror", temperature=0, max_tokens=200)
    expect(page.page.locator("#fig-tokens")).to_have_text(re.compile(r"^([5-9]|\d\d)$"), timeout=30000)
    assert metric(scrape(server.url), "num_requests_running") == 1
    page.page.click("#stop")
    expect(page.page.locator("#status")).to_contain_text("stopped")
    assert wait_for(lambda: metric(scrape(server.url), "request_success_total", finished_reason="abort") == before + 1
                    and metric(scrape(server.url), "num_requests_running") == 0, timeout=5)
    assert int(page.figure("tokens")) < 200 and page.page.is_enabled("#send")


def test_compare_with_ar_shows_the_same_text_twice(page):
    expect(page.page.locator("#model")).to_have_text("tiny")
    page.ask(PROMPT, mode="sd", temperature=0, max_tokens=40, gamma=3)
    page.wait_done()
    page.page.click("#compare-button")
    expect(page.page.locator("#compare-summary")).to_contain_text("speedup", timeout=60000)
    left, right = page.page.text_content("#compare-left"), page.page.text_content("#compare-right")
    assert left == right == page.answer().text_content() and len(left) > 0
    summary = page.page.text_content("#compare-summary")
    assert "identical text" in summary and re.search(r"speedup \d+\.\d\d×", summary)
    assert page.page.locator("#compare-right .t").count() == page.page.locator("#compare-right .o-target").count()
    assert page.page.text_content("#compare-left-title") == "sd (γ 3)"


def test_server_page_lists_the_requests(page):
    expect(page.page.locator("#model")).to_have_text("tiny")
    page.ask(PROMPT, mode="mirror", temperature=0, max_tokens=20)
    page.wait_done()
    page.page.click("#tab-server")
    expect(page.page.locator("#srv-running")).to_have_text("0")
    first = page.page.locator("#srv-recent tbody tr").first
    expect(first).to_contain_text("mirror")
    cells = first.locator("td").all_text_contents()
    assert cells[3] == "length" and cells[4].endswith("→ 20") and cells[8].endswith("%")
    assert re.fullmatch(r"\d+ ms", cells[5]) and re.fullmatch(r"\d+\.\d", cells[6])  # "27547.5 ms", raw rates
    assert re.fullmatch(r"\d\.\d\d", cells[7])  # accepted length as the chat shows it ("2.333" beside "2.54")
    expect(page.page.locator("#srv-engine")).to_contain_text("target on torch:cpu (fp64)")
    assert page.page.is_hidden("#chat")


def test_keyboard_only_at_phone_width(browser, server):
    phone = Page(browser, server.url, viewport={"width": 390, "height": 844}, has_touch=True)
    try:
        page = phone.page
        expect(page.locator("#model")).to_have_text("tiny")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the phone
        page.focus("#prompt")
        page.keyboard.type(PROMPT)
        page.keyboard.press("Enter")
        phone.wait_done()
        page.focus(".message.assistant .tokens")
        page.keyboard.press("ArrowRight")
        expect(page.locator("#tip")).to_be_visible()
        expect(page.locator("#tip")).to_contain_text(re.compile(r"window \d+ · position \d+|first token"))
        page.keyboard.press("End")
        assert page.evaluate("document.activeElement.classList.contains('t')")
        page.focus("#tab-chat")
        page.keyboard.press("ArrowRight")
        expect(page.locator("#tab-server")).to_be_focused()
        expect(page.locator("#server")).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        assert phone.errors == []
    finally:
        phone.close()


def test_the_key_is_asked_for_and_kept(browser, slow_engine):
    guarded = start(slow_engine, api_key="s3cret")
    opened = Page(browser, guarded.url)
    try:
        page = opened.page
        expect(page.locator("#key-dialog")).to_be_visible()
        page.fill("#key-input", "s3cret")
        page.press("#key-input", "Enter")
        expect(page.locator("#model")).to_have_text("tiny")
        assert page.evaluate("localStorage.getItem('mirror-rt.api-key')") == "s3cret"
        page.reload()
        expect(page.locator("#model")).to_have_text("tiny")
        assert page.locator("#key-dialog").is_hidden()
        opened.ask(PROMPT, max_tokens=8)
        opened.wait_done()
    finally:
        opened.close()
        guarded.stop()


def test_an_answer_stopped_before_its_first_token_is_left_out_of_the_conversation(browser, server):
    """The stopped exchange went into the history as an empty assistant turn, after which the model answered every
    later question with nothing; it is left out, and its prompt is put back in the box."""
    page = Page(browser, server.url)
    held = []

    def hold_the_first(route):
        if held:
            route.continue_()
        else:
            held.append(route)  # never answered: the answer is stopped before its first token

    try:
        expect(page.page.locator("#model")).to_have_text("tiny")
        page.page.route("**/v1/chat/completions", hold_the_first)
        page.ask("first question", max_tokens=8)
        expect(page.page.locator("#stop")).to_be_enabled()
        expect(page.page.locator("#status")).to_contain_text("waiting for the first token")  # it was blank
        page.page.click("#stop")
        expect(page.page.locator("#status")).to_contain_text("stopped")
        assert held and page.page.input_value("#prompt") == "first question"
        with page.page.expect_request("**/v1/chat/completions") as request:
            page.ask("second question", max_tokens=8)
        sent = request.value.post_data_json["messages"]
        assert [m for m in sent if m["role"] != "system"] == [{"role": "user", "content": "second question"}], sent
        page.wait_done()
        assert page.answer().text_content()
    finally:
        page.close()


def test_the_page_explains_its_terms_and_its_empty_chart(page):
    """Each term has its explanation where it appears (a tooltip, and a legend line for the figures); the acceptance
    chart says why it is empty instead of a blank box; the server table's columns say what they count."""
    expect(page.page.locator("#model")).to_have_text("tiny")
    expect(page.page.locator("#fig-chart")).to_contain_text("No draft windows yet")
    for term in ("TTFT", "mean accepted length", "hidden draft share", "reuse rate", "tokens"):
        title = page.page.locator(".figures dt", has_text=term).first.get_attribute("title")
        assert title and len(title) > 20, term
    assert "γ" in page.page.text_content("label[for=gamma]") and page.page.get_attribute("label[for=gamma]", "title")
    for mode in ("mirror", "sd", "ar"):
        assert page.page.get_attribute(f"#mode option[value={mode}]", "title")
    expect(page.page.locator("#figures-note")).to_contain_text("Mean accepted length: tokens per target verification")
    page.ask(PROMPT, mode="ar", temperature=0, max_tokens=6)
    page.wait_done()
    expect(page.page.locator("#fig-chart")).to_contain_text("ar answers and target-only steps draft none")
    expect(page.page.locator("#mode-ran")).to_have_text("Ran: ar, target only, as asked")
    page.page.click("#tab-server")
    headers = page.page.locator("#srv-recent th").all_text_contents()
    assert "prompt → output tokens" in headers and "speculative steps" in headers
    assert all(page.page.locator("#srv-recent th").nth(i).get_attribute("title") for i in range(2, len(headers)))
    expect(page.page.locator("#srv-recent tbody tr").first.locator("td").nth(9)).to_have_text("0 of 5")
    expect(page.page.locator("#srv-totals")).to_contain_text(re.compile(r"KV in use\s*\d+% of [\d.]+ MB"))
    assert page.page.locator("#srv-totals dt", has_text="prefix cache").get_attribute("title")


def test_tokens_are_counted_one_way_the_end_included(page):
    """An answer that ends with the end-of-sequence token (here a schema's, set on the request on its way): the
    figure, the legend and the server's usage all count it (the page said "8 tokens" beside a legend of 7), and a
    mark shows where it ended; the side line says what ran."""
    import json

    def with_schema(route):
        body = json.loads(route.request.post_data) | {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"enum": ["yes", "no"]}}}}
        route.continue_(post_data=json.dumps(body))

    expect(page.page.locator("#model")).to_have_text("tiny")
    page.page.route("**/v1/chat/completions", with_schema)
    page.ask(PROMPT, mode="mirror", temperature=0, max_tokens=20)
    page.wait_done()
    expect(page.page.locator("#status")).to_have_text("done (stop)")
    counts = sum(map(int, page.page.locator("#legend .count").all_text_contents()))
    assert counts == int(page.figure("tokens")) and counts > len(page.answer().text_content())  # the end counted
    assert page.answer().locator(".t.end").count() == 1 and page.answer().text_content() in ('"yes"', '"no"')
    expect(page.page.locator("#mode-ran")).to_contain_text("Ran: mirror in")
    assert float(page.figure("mal")) > 1  # 1 + accepted per step: never 1.00 beside 100% acceptance
    assert page.errors == []
