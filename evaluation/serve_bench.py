"""`mirror-rt bench-serve`: load an OpenAI-compatible server and report what vLLM's `bench serve` reports.

Streamed greedy chat completions with `ignore_eos`, per concurrency level: completed and failed requests, throughput,
TTFT, TPOT, ITL per token (a chunk's gap spread over the tokens it carries) and end-to-end percentiles, acceptance
from the server's /metrics; a burst counts the 503s. Peers (evaluation.genai_serve, engine_peer) run each level after
ours, each in its own process (evaluation.peer_process: a peer that dies is a skipped row), on the server's own token
ids, in one table per level. Nothing here imports the server.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from mirror_rt.evaluation.server_ready import ServerError, envelope_message

WARMUP_TOKENS = 8  # per warm-up request (every engine, before the levels)


def _message(exc) -> str:
    """An API error's one-line message (OpenAI's envelope's `message`, else the exception's text)."""
    return envelope_message(getattr(exc, "body", None)) or " ".join(str(exc.message).split())[:200]


@dataclass
class Result:
    """One request as the client saw it (seconds from its start)."""

    ok: bool
    status: int = 200
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)  # per generated token after the first
    text: str = ""
    error: str = ""  # why it failed, as the server or the connection said


async def one_request(client, model: str, messages: list, max_tokens: int) -> Result:
    """A streamed chat completion; per-token gaps from the usage each chunk carries."""
    import openai

    start = time.perf_counter()
    result, last_at, last_count, pieces = Result(ok=False), None, 0, []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            count = chunk.usage.completion_tokens if chunk.usage else last_count
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if result.ttft is None:
                    result.ttft = now - start
                elif count > last_count:
                    result.token_gaps += [(now - last_at) / (count - last_count)] * (count - last_count)
                last_at, last_count = now, count
            if chunk.usage and not chunk.choices:
                result.tokens = chunk.usage.completion_tokens
        result.ok = result.tokens > 0
    except openai.APIStatusError as exc:
        result.status, result.error = exc.status_code, f"{exc.status_code} {_message(exc)}"
    except openai.APIError as exc:
        result.status, result.error = 0, f"{type(exc).__name__}: {exc}"
    result.e2e, result.text = time.perf_counter() - start, "".join(pieces)
    return result


async def run_level(client, model: str, prompts: list, max_tokens: int, concurrency: int) -> tuple[list, float]:
    """All prompts with at most `concurrency` in flight; (results, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(messages):
        async with gate:
            return await one_request(client, model, messages, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(m) for m in prompts))
    return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(results: list[Result], wall: float, concurrency: int) -> dict:
    """vLLM BenchmarkMetrics-style figures (ms), for one level."""
    done = [r for r in results if r.ok]
    ttft = [1e3 * r.ttft for r in done if r.ttft is not None]
    itl = [1e3 * g for r in done for g in r.token_gaps]
    tpot = [1e3 * (r.e2e - r.ttft) / (r.tokens - 1) for r in done if r.tokens > 1 and r.ttft is not None]
    output = sum(r.tokens for r in done)

    def ms(values, q):
        value = percentile(values, q)
        return None if value is None else round(value, 1)

    reasons = statistics.multimode(r.error or f"status {r.status}" for r in results if not r.ok)
    return {"concurrency": concurrency, "completed": len(done), "failed": len(results) - len(done),
            "failure": reasons[0] if reasons else None,  # the most common reason
            "duration_s": round(wall, 2), "request_throughput": round(len(done) / wall, 3),
            "output_throughput": round(output / wall, 1), "median_ttft_ms": ms(ttft, 50), "p95_ttft_ms": ms(ttft, 95),
            "median_itl_ms": ms(itl, 50), "p95_itl_ms": ms(itl, 95),
            "mean_tpot_ms": round(statistics.fmean(tpot), 1) if tpot else None,
            "median_e2el_ms": ms([1e3 * r.e2e for r in done], 50)}


async def burst(client, model: str, messages: list, max_tokens: int, size: int) -> dict:
    """`size` requests at once: how many were refused (503), how fast, and the admitted ones' TTFT."""
    results = await asyncio.gather(*(one_request(client, model, messages, max_tokens) for _ in range(size)))
    refused = [r for r in results if r.status == 503]
    admitted = [r for r in results if r.ok]
    return {"burst": size, "admitted": len(admitted), "refused_503": len(refused),
            "other_failures": size - len(admitted) - len(refused),
            "max_refusal_ms": round(1e3 * max((r.e2e for r in refused), default=0.0), 1),
            "max_admitted_ttft_ms": round(1e3 * max((r.ttft for r in admitted if r.ttft), default=0.0), 1)}


def delta(before: dict, after: dict, name: str) -> float:
    """How much a /metrics counter grew over the run."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def speculation(before: dict, after: dict) -> dict:
    """Acceptance over the run from the /metrics counters (PromQL's rate ratios, as deltas)."""
    drafts = delta(before, after, "spec_decode_num_drafts_total")
    drafted = delta(before, after, "spec_decode_num_draft_tokens_total")
    accepted = delta(before, after, "spec_decode_num_accepted_tokens_total")
    return {"acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None}


def prefix_hits(before: dict, after: dict) -> dict:
    """The share of prompt tokens the server's prefix cache served over the run (None: no prefix cache)."""
    queries = delta(before, after, "prefix_cache_queries_total")
    hits = delta(before, after, "prefix_cache_hits_total")
    return {"prefix_cache_hit_rate": round(hits / queries, 3) if queries else None}


def scrape_totals(url: str) -> dict:
    """Counter totals of the server's /metrics, summed over labels, without the `mirror_rt:` prefix."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1]
            totals[name] = totals.get(name, 0.0) + sample.value
    return totals


async def load_run(url: str, prompts: list, levels: list[int], max_tokens: int, burst_size: int,
                   api_key: str | None, log=print, peers: tuple = ()) -> dict:
    """Every concurrency level (ours over HTTP, then each peer in process on the same prompts), then the burst;
    returns the report."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    ours, served = await served_label(client, model, prompts[0])
    skipped = {p.name: p.skipped for p in peers if getattr(p, "skipped", None)}  # a peer's process died loading

    def unless_crashed(peer, call):
        """`call()`, or None once the peer's process is dead (its row then says why, at every level)."""
        from mirror_rt.evaluation.peer_process import PeerCrashed

        if peer.name in skipped:
            return None
        try:
            return call()
        except PeerCrashed as exc:
            skipped[peer.name] = f"{exc} while running"
            log(f"bench-serve: skipping {peer.name}: {skipped[peer.name]}")
            return None

    for peer in peers:  # a peer that runs our engine loads the server's precision and mode
        if hasattr(peer, "follow"):
            unless_crashed(peer, lambda p=peer: p.follow(served.get("precision") or {}, served.get("mode"),
                                                         served.get("path")))
    report = {"url": url, "model": model, "max_tokens": max_tokens, "prompts": len(prompts), "ours": ours,
              "levels": []}
    # the same unmeasured warm-up for every engine (the widest level's prompts, 8 tokens each): first use is not timed
    await run_level(client, model, prompts[:max(levels)], WARMUP_TOKENS, max(levels))
    prompt_ids = [tokenize(url, messages) for messages in prompts] if peers else []
    for peer in peers:
        unless_crashed(peer, lambda p=peer: p.run_level(prompt_ids[:max(levels)], WARMUP_TOKENS, max(levels)))
        report.setdefault("peers", {})[peer.name] = ({"skipped": skipped[peer.name]} if peer.name in skipped else
                                                     {"label": peer.label, "precision": peer.precision})
    for concurrency in levels:
        before = scrape_totals(url)
        results, wall = await run_level(client, model, prompts, max_tokens, concurrency)
        if not any(r.ok or r.status for r in results):  # nothing answered: the server is gone, the rest would fail
            raise ServerError(f"the server at {url} stopped answering at concurrency {concurrency} "
                              f"({results[0].error})")
        after = scrape_totals(url)
        level = summarize(results, wall, concurrency) | speculation(before, after) | prefix_hits(before, after)
        log(format_level(level))
        if peers and level["prefix_cache_hit_rate"]:
            log(f"bench-serve: the server's prefix cache served {level['prefix_cache_hit_rate']:.0%} of the prompt "
                "tokens of this level (every level repeats the same prompts; the peers' prefix caching is off): "
                "serve with --no-prefix-cache to compare like with like")
        for peer in peers:
            ran = unless_crashed(peer, lambda p=peer, n=concurrency: p.run_level(
                prompt_ids, max_tokens, n, decode=lambda ids: detokenize(url, ids)))
            if ran is None:
                level.setdefault("peers", {})[peer.name] = {"skipped": skipped[peer.name]}
                continue
            peer_results, peer_wall = ran
            same = sum(r.ok and r.text == o.text for r, o in zip(peer_results, results) if o.ok)
            level.setdefault("peers", {})[peer.name] = summarize(peer_results, peer_wall, concurrency) | {
                "same_text_as_ours": same}
        if peers:
            log(format_table(level, ours, peers, len(prompts), max_tokens))
        report["levels"].append(level)
    if burst_size:
        report["burst"] = await burst(client, model, prompts[0], max_tokens, burst_size)
        log(format_burst(report["burst"]))
    return report


async def served_label(client, model: str, messages: list) -> tuple[str, dict]:
    """What the server runs, from a short non-streamed answer: (its mode and each role's precision as one line,
    mirror-rt's `mirror_rt` object; another server: '?' and {})."""
    answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    extra = (answer.model_extra or {}).get("mirror_rt") or {}
    precision = extra.get("precision") or {}
    roles = ", ".join(f"{p} {role}" for role, p in precision.items() if p)
    return f"{extra.get('mode', '?')}; {roles or '?'}", extra


def tokenize(url: str, messages: list) -> list[int]:
    """The prompt's token ids as the server makes them (its /tokenize: chat template, generation prompt)."""
    return _post(url, "/tokenize", {"messages": messages})["tokens"]


def detokenize(url: str, ids: list[int]) -> str:
    return _post(url, "/detokenize", {"tokens": list(ids)})["prompt"]


def _post(url: str, route: str, body: dict) -> dict:
    import httpx

    response = httpx.post(url.rstrip("/") + route, json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def format_table(level: dict, ours: str, peers, prompts: int, max_tokens: int) -> str:
    """One markdown table for one concurrency: ours over HTTP, each peer in process, side by side."""
    head = (f"concurrency {level['concurrency']}: the same {prompts} prompts, {max_tokens} tokens each, greedy, "
            f"ignore_eos; mirror-rt serve over HTTP, the peers without HTTP\n"
            "| engine | precision | where | done | tok/s | req/s | TTFT p50/p95 ms | ITL p50/p95 ms | TPOT ms | "
            "E2E p50 ms | text = ours |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [_row("mirror-rt serve", ours, "HTTP", level, "-")]
    for peer in peers:
        figures = level["peers"][peer.name]
        if "skipped" in figures:  # its process died: the row says why
            rows.append(f"| {peer.name} | - | - | skipped: {figures['skipped']} |" + " - |" * 7)
            continue
        rows.append(_row(peer.name, peer.precision_label, peer.where, figures,
                         f"{figures['same_text_as_ours']}/{prompts}"))
    return "\n".join([head, *rows])


def _row(engine: str, precision: str, where: str, f: dict, same: str) -> str:
    return (f"| {engine} | {precision} | {where} | {f['completed']}/{f['completed'] + f['failed']} | "
            f"{f['output_throughput']:.1f} | {f['request_throughput']:.2f} | "
            f"{f['median_ttft_ms']}/{f['p95_ttft_ms']} | "
            f"{f['median_itl_ms']}/{f['p95_itl_ms']} | {f['mean_tpot_ms']} | {f['median_e2el_ms']} | {same} |")


def format_level(level: dict) -> str:
    failure = f" (most often: {level['failure']})" if level.get("failure") else ""
    return (f"concurrency {level['concurrency']}: {level['completed']} done, {level['failed']} failed{failure}, "
            f"{level['request_throughput']:.2f} req/s, {level['output_throughput']:.1f} tok/s, TTFT p50/p95 "
            f"{level['median_ttft_ms']}/{level['p95_ttft_ms']} ms, ITL p50/p95 {level['median_itl_ms']}/"
            f"{level['p95_itl_ms']} ms, TPOT {level['mean_tpot_ms']} ms, acceptance {level['acceptance_rate']}, "
            f"mean accepted length {level['mean_accepted_length']}, prefix cache hits "
            f"{level.get('prefix_cache_hit_rate')}")


def format_burst(b: dict) -> str:
    return (f"burst of {b['burst']}: {b['admitted']} admitted, {b['refused_503']} refused with 503 (slowest "
            f"refusal {b['max_refusal_ms']} ms), {b['other_failures']} other failures; slowest admitted TTFT "
            f"{b['max_admitted_ttft_ms']} ms")


async def compare_with_run(url: str, prompts: list, max_tokens: int, mode: str | None, api_key: str | None,
                           cache_dir: str | None = None, log=print) -> dict:
    """Single stream, side by side: each prompt through HTTP, then through the engine `run` uses, in this
    process while the server idles. Tokens/s of each (prefill included) and whether the texts match."""
    from openai import AsyncOpenAI

    from mirror_rt.devices.engines import load_engine
    from mirror_rt.devices.options import EngineConfig

    engine = load_engine(EngineConfig.from_flags(cache_dir=cache_dir), mode, log=lambda *a: None)
    mode = mode or engine.default_mode  # None: the engine's, as the server's
    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    engine.generate(prompts[0], mode=mode, max_new_tokens=8)  # warm-up of both
    await one_request(client, model, prompts[0], 8)
    http_rates, run_rates, same = [], [], 0
    for messages in prompts:
        over_http = await one_request(client, model, messages, max_tokens)
        gen = engine.generate(messages, mode=mode, max_new_tokens=max_tokens, ignore_eos=True)
        http_rates.append(over_http.tokens / over_http.e2e)
        run_rates.append(gen.stats["new_tokens"] / gen.stats["wall_time_s"])
        same += over_http.text == gen.text
    result = {"mode": mode, "prompts": len(prompts), "http_tokens_per_s": round(statistics.fmean(http_rates), 2),
              "run_tokens_per_s": round(statistics.fmean(run_rates), 2), "same_text": same,
              "precision": f"{engine.names.get('target_precision')} target, "
                           f"{engine.names.get('draft_precision')} draft"}
    result["http_vs_run"] = round(result["http_tokens_per_s"] / result["run_tokens_per_s"], 3)
    log(f"single stream ({mode}, {result['precision']}): {result['http_tokens_per_s']} tok/s over HTTP, "
        f"{result['run_tokens_per_s']} tok/s in process (run), ratio {result['http_vs_run']}; same text "
        f"{same}/{len(prompts)}")
    return result
