"""`mirror-rt bench` and `mirror-rt bench-serve`: parsers and commands (the work is in mirror_rt.evaluation)."""

from __future__ import annotations

import argparse
import json
import sys

from mirror_rt.cli.options import (
    add_decoding_options,
    add_engine_options,
    add_request_options,
    count,
    engine_config,
    generation_config,
    log,
    output_file,
    output_folder,
    positive_int,
    positive_number,
)
from mirror_rt.evaluation.server_ready import READY_TIMEOUT
from mirror_rt.evaluation.specbench import DEFAULT_QUESTIONS
from mirror_rt.runtime.config import DEFAULTS

# The engine flags the bench uses: ours run the engine `run` would pick; --model also names the peers' target.
BENCH_ENGINE = ("model", "draft_model", "bundle", "torch", "draft_bundle", "draft_precision", "compile", "cache_dir")


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="SpecBench-style evaluation of ar / sd / mirror and peers")
    bench.add_argument("--data", default=DEFAULT_QUESTIONS, help="questions: a SpecBench jsonl (question_id, "
                       "category, turns) or a set shipped with mirror-rt by name (default %(default)s: SpecBench's "
                       "dev questions)")
    bench.add_argument("--categories", help="comma-separated categories to keep")
    bench.add_argument("--limit", type=positive_int, help="number of questions, picked evenly across categories")
    bench.add_argument("--methods", default="ar,sd,mirror", help="comma-separated: ar,sd,mirror,mirror-no-lookup,"
                       "ar-bf16,mirror-bf16 (a torch bf16 target with the bundle's draft),ar-bf16-compiled,"
                       "mirror-bf16-compiled (the same under torch.compile, beside the eager rows),hf-assisted,"
                       "ov-genai (GenAI's default precision),ov-genai-f32,ov-genai-sd,llama-cpp,llama-cpp-lookup "
                       "(llama.cpp on the model's GGUF, plain and with prompt lookup: pip install -e \".[llama-cpp]\"),"
                       "ar-P,sd-P,mirror-P (the default model's bundle with its target at precision P: fp32, int8, "
                       "int4, q4_1, w8a8),mirror-replay[:alpha],sd-replay[:alpha] (an instrument: the draft's "
                       "forwards run, but it proposes the target's own greedy text, each token kept with probability "
                       "alpha, default 1)")
    bench.add_argument("--repeats", type=positive_int, default=1, help="runs per turn (median wall time kept)")
    add_engine_options(bench, BENCH_ENGINE)
    add_decoding_options(bench, mode=False)
    add_request_options(bench)
    bench.add_argument("--profile", action="store_true", help="print mirror's time per phase per step")
    bench.add_argument("--out", type=output_folder, help="output folder (required but with --rows)")
    bench.add_argument("--rows", help="instead of questions: the target's cost of one forward of N new rows for each "
                       "N of this comma-separated list (e.g. 1,2,4,8,64,256), beside llama.cpp's where installed")


def cmd_bench(args) -> int:
    import shlex
    from pathlib import Path

    from mirror_rt.evaluation import report
    from mirror_rt.evaluation.bench import BenchConfig, format_profile, report_row, run_bench, write_results
    from mirror_rt.evaluation.bench_engines import bench_runners
    from mirror_rt.evaluation.specbench import read_questions

    if args.rows:
        return cmd_rows(args)
    missing = [flag for flag, value in (("--data", args.data), ("--out", args.out)) if not value]
    if missing:
        raise ValueError(f"bench needs {' and '.join(missing)} (or --rows N,... for the per-row cost)")
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None  # "a, b": b
    questions = read_questions(args.data, categories, args.limit)
    if not questions:  # a report of 0 questions at 0.0 tokens/s said nothing
        raise ValueError(f"{args.data}: no questions in it")
    config = generation_config(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods names no method")
    runners = bench_runners(methods, engine_config(args), log=log)
    if not runners:
        raise ValueError(f"none of --methods {args.methods} can run here (see the lines above)")
    answers = run_bench(runners, questions, BenchConfig(config=config, repeats=args.repeats), log=log)
    command = "mirror-rt " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = {r.name: report_row(r) for r in runners}
    skipped = {r.name: r.skipped for r in runners if getattr(r, "skipped", None)}  # peers whose process died
    doc = write_results(Path(args.out), answers, rows, command, greedy=config.sampling.greedy, skipped=skipped)
    print((Path(args.out) / "report.md").read_text())
    if args.profile and "mirror" in answers:
        print(format_profile(answers["mirror"]))
    # our speculative rows must equal ar over the same target, token for token, at every precision
    exact = [m for m, row in rows.items() if row.ours and not row.target_only and m in doc["references"]
             and report.same_target(rows, m, doc["references"][m])]
    return 1 if any(doc["mismatches"].get(m) for m in exact) else 0


def cmd_rows(args) -> int:
    """`bench --rows`: the target's cost per forward of N rows (evaluation.rows_bench), as the engine `run` loads."""
    from mirror_rt.devices.engines import load_engine
    from mirror_rt.evaluation import rows_bench
    from mirror_rt.runtime.affinity import available_cores

    counts = rows_bench.row_counts(args.rows)
    engine = load_engine(engine_config(args), mode="ar", log=log)
    threads = getattr(engine.placement, "target_threads", None) or len(available_cores())
    llm, llama = rows_bench.llama_model(args.model, args.cache_dir, threads, max(counts))
    costs = rows_bench.measure(engine, counts, llm, log=log)
    print(rows_bench.table(costs, rows_bench.cpu_line(), llama, threads))
    return 0


def concurrency_levels(text: str) -> list[int]:
    """bench-serve's --concurrency: comma-separated whole numbers >= 1, each once."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() and int(item) >= 1 for item in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got '{text}'")
    if len(set(map(int, items))) < len(items):
        raise argparse.ArgumentTypeError(f"a level is named twice in '{text}'")
    return [int(item) for item in items]


def _add_bench_serve(sub) -> None:
    load = sub.add_parser("bench-serve", help="load a running server (OpenAI API): throughput, TTFT, ITL per "
                          "token, acceptance, a burst past the queue")
    load.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    load.add_argument("--data", default=DEFAULT_QUESTIONS, help="questions (a SpecBench jsonl, or a shipped set by "
                      "name; default %(default)s); their first turns are the prompts")
    load.add_argument("--limit", type=positive_int, default=16, help="questions, picked evenly across categories")
    load.add_argument("--concurrency", type=concurrency_levels, default="1,2,4",
                      help="comma-separated levels (default 1,2,4)")
    load.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request (ignore_eos)")
    load.add_argument("--burst", type=count, default=0, help="then send this many at once (0: no burst)")
    load.add_argument("--compare-run", action="store_true", help="also single-stream each prompt in this process "
                      "through the engine `run` uses (the server idle meanwhile): HTTP overhead")
    load.add_argument("--mode", default=DEFAULTS.mode, help="the server's mode, for --compare-run (default: the "
                      "engine's, as the server's)")
    load.add_argument("--api-key", help="the server's key (default: $MIRROR_RT_API_KEY)")
    load.add_argument("--ready-timeout", type=positive_number, default=READY_TIMEOUT,
                      help=f"seconds to wait for a server that is still starting (default {READY_TIMEOUT:g})")
    load.add_argument("--peers", default="", help="comma-separated peers run after each level, each in its own "
                      "process, on the server's token ids: ov-genai-cb (OpenVINO GenAI's ContinuousBatchingPipeline "
                      "at its default precision), ov-genai-cb-f32 (f32 compute and KV), mirror-rt-engine (the server's "
                      "engine, default model at the server's precision and mode, without HTTP)")
    load.add_argument("--model", help="the peers' model: HF folder, .gguf file or preset (default: the default model; "
                      "name the model the server serves)")
    load.add_argument("--threads", type=positive_int, help="the peers' threads (default: every core, as the server)")
    load.add_argument("--cache-dir")
    load.add_argument("--json", type=output_file, help="write the report here too")


def cmd_bench_serve(args) -> int:
    import asyncio
    import os

    from mirror_rt.evaluation.peer_process import check_serve_peers, serve_peers
    from mirror_rt.evaluation.serve_bench import compare_with_run, load_run
    from mirror_rt.evaluation.server_ready import ServerError, wait_until_ready
    from mirror_rt.evaluation.specbench import read_questions
    from mirror_rt.runtime.affinity import available_cores

    questions = read_questions(args.data, None, args.limit)
    if not questions:
        raise ValueError(f"{args.data}: no questions in it")
    prompts = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    key = args.api_key or os.environ.get("MIRROR_RT_API_KEY")
    names = [p.strip() for p in args.peers.split(",") if p.strip()]
    check_serve_peers(names)  # before the server is asked
    import httpx
    import openai

    report = {}
    try:  # the server first, before any peer loads; then a server lost mid-run is one line too
        wait_until_ready(args.url, key, args.ready_timeout, log=log)
        peers = serve_peers(names, args.model, args.threads or len(available_cores()), args.cache_dir, log=log)
        if args.compare_run:
            report["single_stream"] = asyncio.run(compare_with_run(args.url, prompts, args.max_tokens, args.mode, key,
                                                                   args.cache_dir, log=log))
        report |= asyncio.run(load_run(args.url, prompts, args.concurrency, args.max_tokens, args.burst, key,
                                       log=log, peers=peers))
    except ServerError as exc:
        log(f"mirror-rt: error: {exc}")
        return 1
    except (openai.APIError, httpx.HTTPError) as exc:
        log(f"mirror-rt: error: the server at {args.url} failed the run: {type(exc).__name__}: {exc}")
        return 1
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(report, indent=2))
    runs = [*report["levels"], *(p for level in report["levels"] for p in level.get("peers", {}).values())]
    return 0 if all(run.get("failed", 0) == 0 for run in runs) else 1  # a skipped peer said why, and is no failure


COMMANDS = {"bench": cmd_bench, "bench-serve": cmd_bench_serve}


def add_bench(sub) -> None:
    _add_bench(sub)
    _add_bench_serve(sub)
