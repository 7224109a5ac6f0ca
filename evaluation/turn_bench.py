"""A chat's second turn on servers side by side: its time to first token, and the prefix cache's share in it.

Each two-turn question runs turn 1, then turn 2 (with the server's own answer), greedy, on every server in turn.
Per server: both turns' TTFT (p50, mean), the prompt tokens and the prefix-cache hits its /metrics counted.

    python -m mirror_rt.evaluation.turn_bench --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 \\
        --data specbench-dev --limit 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from mirror_rt.evaluation.serve_bench import delta, one_request, scrape_totals
from mirror_rt.evaluation.specbench import read_questions


async def two_turns(client, model: str, question, max_tokens: int) -> tuple:
    """(turn 1, turn 2) Results of one question."""
    messages = [{"role": "user", "content": question.turns[0]}]
    first = await one_request(client, model, messages, max_tokens)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": question.turns[1]}]
    return first, await one_request(client, model, messages, max_tokens)


async def run(urls: list[str], questions: list, max_tokens: int) -> dict:
    import openai

    clients = [openai.AsyncOpenAI(base_url=u.rstrip("/") + "/v1", api_key="unused", max_retries=0) for u in urls]
    models = [(await c.models.list()).data[0].id for c in clients]
    before = [scrape_totals(u) for u in urls]
    turns: dict[str, list] = {u: [] for u in urls}
    for question in questions:
        for url, client, model in zip(urls, clients, models):
            turns[url].append(await two_turns(client, model, question, max_tokens))
    after = [scrape_totals(u) for u in urls]
    return {url: summary(turns[url], b, a) for url, b, a in zip(urls, before, after)}


def summary(pairs: list, before: dict, after: dict) -> dict:
    def ms(values):
        return round(1e3 * statistics.median(values), 1), round(1e3 * statistics.fmean(values), 1)

    failed = sum(not (a.ok and b.ok) for a, b in pairs)
    ok = [(a, b) for a, b in pairs if a.ok and b.ok]
    return {"questions": len(pairs), "failed": failed,
            "turn1_ttft_ms": ms([a.ttft for a, _ in ok]) if ok else None,
            "turn2_ttft_ms": ms([b.ttft for _, b in ok]) if ok else None,
            "prefix_cache_queries": int(delta(before, after, "prefix_cache_queries_total")),
            "prefix_cache_hits": int(delta(before, after, "prefix_cache_hits_total")),
            "prompt_tokens": int(delta(before, after, "prompt_tokens_total"))}


def report(results: dict, max_tokens: int) -> str:
    lines = [f"two turns per question, greedy, {max_tokens} tokens each (ignore_eos), servers in turn per question",
             "| server | questions | turn 1 TTFT p50 / mean ms | turn 2 TTFT p50 / mean ms | prompt tokens | "
             "prefix-cache hits / queries (tokens) |", "|---|---|---|---|---|---|"]
    for url, r in results.items():
        t1, t2 = r["turn1_ttft_ms"] or ("-", "-"), r["turn2_ttft_ms"] or ("-", "-")
        lines.append(f"| {url} | {r['questions'] - r['failed']}/{r['questions']} | {t1[0]} / {t1[1]} | "
                     f"{t2[0]} / {t2[1]} | {r['prompt_tokens']} | {r['prefix_cache_hits']} / "
                     f"{r['prefix_cache_queries']} |")
    rows = [r for r in results.values() if r["turn2_ttft_ms"]]
    if len(rows) == 2:
        lines.append(f"turn 2 TTFT, second server / first (p50): "
                     f"{rows[1]['turn2_ttft_ms'][0] / rows[0]['turn2_ttft_ms'][0]:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mirror_rt.evaluation.turn_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="a server (repeat: side by side)")
    parser.add_argument("--data", required=True, help="SpecBench jsonl; questions with two turns are used")
    parser.add_argument("--limit", type=int, default=8, help="questions (default 8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per turn (default 64)")
    args = parser.parse_args(argv)
    questions = [q for q in read_questions(args.data) if len(q.turns) >= 2][:args.limit]
    if not questions:
        parser.error(f"{args.data} has no question with two turns")
    print(report(asyncio.run(run(args.url, questions, args.max_tokens)), args.max_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
