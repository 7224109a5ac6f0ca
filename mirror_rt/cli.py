"""The `mirror-rt` command line: argument parsing and dispatch only (training and evaluation subcommands:
`cli_training`; argument types: `cli_args`).

Every user error ends as one line on stderr (`mirror-rt: error: ...`) and exit code 2;
Ctrl-C exits with 130 after the committed text was printed.
"""

from __future__ import annotations

import argparse
import json
import sys

from mirror_rt.cli_args import budget, count, log, number, port_number, positive_int, positive_number
from mirror_rt.cli_bench import COMMANDS as BENCH_COMMANDS
from mirror_rt.cli_bench import add_bench
from mirror_rt.cli_replicas import add_replica_options, cluster_settings, serve_on_ray, wants_ray
from mirror_rt.cli_training import COMMANDS as TRAINING_COMMANDS
from mirror_rt.cli_training import add_training
from mirror_rt.devices.engines import TORCH_OPTIONS
from mirror_rt.runtime.config import MODES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirror-rt", description="Mirror speculative decoding runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate text for a prompt (argument or stdin)")
    run.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    add_engine_options(run)
    run.add_argument("--max-new-tokens", type=positive_int, default=256)
    run.add_argument("--temperature", type=number, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-p", type=number, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--json-schema", metavar="FILE", help="constrain the output to the JSON schema in FILE")
    run.add_argument("--regex", help="constrain the output to match this regular expression")
    run.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    run.add_argument("--stats", action="store_true", help="print speed and acceptance statistics (stderr)")
    run.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    _add_export(sub)
    _add_devices(sub)
    add_training(sub)
    add_bench(sub)
    simulate = sub.add_parser("simulate", help="predict AR / SD / Mirror speed from costs (latency model)")
    simulate.add_argument("--config", default="qwen3-14b-m2ultra",
                          help="a JSON file of costs and rates, or a preset (default: the paper's setting)")
    simulate.add_argument("--json", action="store_true")
    _add_serve(sub)
    return parser


def add_engine_options(parser) -> None:
    """What runs where, and how it decodes: the options `run` and `serve` share."""
    parser.add_argument("--mode", default="mirror", help=f"decoding mode: {', '.join(MODES)} (default: mirror)")
    parser.add_argument("--gamma", type=positive_int, default=4, help="draft tokens per window (default 4)")
    parser.add_argument("--branch-budget", type=budget, default=None,
                        help="side branches precomputed per step: auto (as many as fit) or N")
    parser.add_argument("--draft-lookup", type=count, default=3,
                        help="mirror, greedy: prompt-lookup guesses the draft checks per forward (0: off)")
    parser.add_argument("--early-exit", default="auto", choices=("auto", "on", "off"),
                        help="mirror: send early-exit candidates (auto: only while the draft has time to use them)")
    parser.add_argument("--model", help="target: HF folder, .gguf file or preset (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft-model", help="torch draft: int8 (an int8 copy of the target, default), target "
                        "(oracle draft), or an HF folder, .gguf file or preset")
    parser.add_argument("--kappa", type=positive_int,
                        help="torch: early-exit candidates per position (mirror; default 8)")
    parser.add_argument("--exit-layer", type=positive_int, help="early-exit layer (mirror; default N/2)")
    parser.add_argument("--device", help="torch device of the target (cpu by default, cuda, cuda:1; as --target)")
    parser.add_argument("--dtype", help="torch target dtype: bf16 on CUDA (fp16 without bf16), else fp32 by "
                        "default; float32 | bfloat16 | float16 | float64 (or fp32, bf16, fp16)")
    parser.add_argument("--compile", action="store_true", default=None,
                        help="torch: static-shape windows under torch.compile (CUDA graphs on CUDA, inductor on CPU)")
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: all cores)")
    parser.add_argument("--cache-dir", help="model cache folder (default: $MIRROR_RT_CACHE or ~/.cache/mirror-rt)")
    parser.add_argument("--bundle", help="run an exported bundle (mirror-rt export) instead of --model (default "
                        "model: its ONNX bundle, exported once into the cache)")
    parser.add_argument("--torch", action="store_true", help="run the default model in torch, not its ONNX bundle")
    parser.add_argument("--draft-bundle", help="take the draft from another bundle (default: --bundle's)")
    parser.add_argument("--target", default="cpu", help="target device: cpu, cuda, cuda:1, gpu, npu, openvino:CPU, "
                        "ort:cpu, ort:qnn, torch:cpu...; without --bundle, cuda runs the target in torch on the GPU")
    parser.add_argument("--draft", default="cpu", help="draft device (same forms; the default bundle's draft, or "
                        "--draft-bundle's, with a CUDA target)")
    parser.add_argument("--strict-devices", action="store_true", help="fail instead of falling back to a CPU backend")
    parser.add_argument("--draft-precision", choices=("f32", "bf16"), help="OpenVINO draft compute precision "
                        "(bf16: faster on bf16 CPUs; the output never changes, only acceptance)")
    parser.add_argument("--draft-streams", help="trained SS streams (mirror-rt train-draft --out) over the draft")


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, "
                           "Prometheus /metrics)")
    add_engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                       "$MIRROR_RT_API_KEY; none when unset)")
    serve.add_argument("--max-queued", type=count, default=16,
                       help="requests waiting beyond the one running; more are refused with 503 (default 16)")
    serve.add_argument("--request-timeout", type=positive_number,
                       help="seconds a generation may run before it is stopped with an error (default: no limit)")
    serve.add_argument("--served-model-name", help="the model name clients send (default: the model's name)")
    serve.add_argument("--drain-timeout", type=positive_number, default=30.0,
                       help="on SIGTERM / Ctrl-C, seconds admitted requests may take to finish (default 30)")
    add_replica_options(serve)


def cmd_serve(args) -> int:
    from mirror_rt.serving.server import serve

    settings, load = serve_parts(args)
    if wants_ray(args):
        return serve_on_ray(args, settings, load, _torch_engine(args))
    return serve(settings, load, args.host, args.port, args.drain_timeout)


def serve_parts(args):
    """`serve`'s ServerSettings and the function that loads its engine (in a replica, with replicas)."""
    import os

    from mirror_rt.devices.engines import load_engine
    from mirror_rt.runtime.config import make_config
    from mirror_rt.serving.app import ServerSettings

    defaults = make_config(mode=args.mode, gamma=args.gamma, branch_budget=args.branch_budget,
                           early_exit=args.early_exit, draft_lookup=args.draft_lookup)
    settings = ServerSettings(served_model_name=args.served_model_name,
                              api_key=args.api_key or os.environ.get("MIRROR_RT_API_KEY") or None,
                              max_queued=args.max_queued, request_timeout_s=args.request_timeout, defaults=defaults)

    def load():
        return load_engine(args.bundle, torch=args.torch, torch_options=torch_options(args), mode=args.mode,
                           **bundle_options(args))

    return settings, load


def ray_serve_app(args: dict):
    """A Ray Serve application builder: `import_path: mirror_rt.cli:ray_serve_app` in a RayService's
    serveConfigV2 (KubeRay), with `args: {options: "<mirror-rt serve options>"}`; the replicas are the
    ones `mirror-rt serve --replicas` runs."""
    import shlex

    from mirror_rt.serving.cluster import build

    parsed = build_parser().parse_args(["serve", *shlex.split(args.get("options", ""))])
    settings, load = serve_parts(parsed)
    return build(settings, cluster_settings(parsed, _torch_engine(parsed)), load)


def _torch_engine(args) -> bool:
    """Whether `load_engine` runs torch eager for these options (else a bundle, the default one included)."""
    return args.bundle is None and (args.torch or any(v is not None for v in torch_options(args).values()))


def _add_devices(sub) -> None:
    devices = sub.add_parser("devices", help="list the devices each backend sees here and where run places its workers")
    devices.add_argument("--check", action="store_true", help="run every device pair found here (random-weight "
                         "SmolLM2 presets, offline): equality, tokens/s, device reads, launches, peak memory")
    devices.add_argument("--models", help="presets to check (default: smollm2-135m, plus smollm2-1.7b with CUDA)")
    devices.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens per run (default 48)")
    devices.add_argument("--compile", action="store_true", help="check the compiled path (torch.compile) instead")
    devices.add_argument("--out", default="devices-check.json", help="JSON file of the check")


def cmd_simulate(args) -> int:
    from mirror_rt.evaluation.simulate import load_config, predict

    cfg = load_config(args.config)
    result = predict(cfg)
    if args.json:
        print(json.dumps({"config": cfg.__dict__, "prediction": result}, indent=2))
        return 0
    print(f"{result['name']}: gamma {cfg.gamma}, acceptance {cfg.acceptance}, tokens per step "
          f"{result['tokens_per_step']}, P(reuse hit) {result['p_hit']}")
    for method in ("ar", "sd", "mirror"):
        step = result["ar_ms_per_token"] if method == "ar" else result[f"{method}_ms_per_step"]
        speedup = 1.0 if method == "ar" else result[f"{method}_speedup"]
        print(f"  {method:6s} {step:8.2f} ms per step  {result[f'{method}_tokens_per_s']:8.1f} tokens/s  "
              f"{speedup:.2f}x")
    return 0


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="split a model into target prefix / suffix and draft graphs (a bundle)")
    export.add_argument("--model", help="target: HF folder, .gguf file or preset (default: SmolLM2-135M-Instruct)")
    export.add_argument("--draft", help="draft model (default: the target itself, with --draft-weights)")
    export.add_argument("--exit-layer", type=positive_int, help="early-exit layer (default N/2)")
    export.add_argument("--kappa", type=positive_int, default=8, help="early-exit candidates per position")
    export.add_argument("--format", default="onnx",
                        help="onnx (default: exact and fastest on CPU here) | openvino | torch")
    export.add_argument("--weights", default="fp32", help="target weights: fp32 | fp16 | int8 | int4")
    export.add_argument("--draft-weights", default="auto",
                        help="draft weights: auto (default: q4_1 where the weights are Q4_1 blocks exactly and the "
                        "format is onnx, else int8) | fp32 | fp16 | int8 | int4 | q4_1 (onnx: 4-bit blocks with a "
                        "minimum, exact for Q4_1 GGUF weights such as the default model's)")
    export.add_argument("--exit-weights", default="int8", help="early-exit head weights: fp32 | int8 (it only "
                                                                "ranks draft branches, never changes the output)")
    export.add_argument("--exit-adapter", help="a trained exit adapter (mirror-rt train-exit) to carry")
    export.add_argument("--kv", help="shared (default with onnx: KV written in place, no copy per call; ONNX "
                        "Runtime only) | explicit (KV in and out: OpenVINO can load the .onnx too)")
    export.add_argument("--draft-streams", help="trained SS streams (mirror-rt train-draft --out) exported in the "
                        "draft graph (onnx); Mirror's greedy rollouts then confirm several tokens per forward")
    export.add_argument("--draft-vocab", help="kept token ids (mirror-rt prune-vocab --out): the draft's LM head "
                        "over those rows only, -inf elsewhere (onnx, openvino; the output never changes)")
    export.add_argument("--static", action="store_true", help="fixed shapes (NPUs need them)")
    export.add_argument("--max-context", type=positive_int, help="context limit of the bundle")
    export.add_argument("--max-window", type=positive_int, help="window limit (with --static)")
    export.add_argument("--out", required=True, help="bundle folder to write")


def cmd_export(args) -> int:
    from mirror_rt.exporters.export import export_bundle

    folder = export_bundle(args.model, args.out, draft_ref=args.draft, exit_layer=args.exit_layer, kappa=args.kappa,
                           fmt=args.format, weights=args.weights, draft_weights=args.draft_weights,
                           static=args.static, max_context=args.max_context, max_window=args.max_window,
                           exit_weights=args.exit_weights, exit_adapter=args.exit_adapter, kv=args.kv,
                           draft_streams=args.draft_streams, draft_vocab=args.draft_vocab)
    print(f"bundle written to {folder}")
    if args.exit_adapter is None:
        print("early exit: untrained; `mirror-rt train-exit` (about 20 min on 2 CPU cores) trains an adapter "
              "that `--exit-adapter` then carries")
    return 0


def cmd_devices(args) -> int:
    from mirror_rt.devices.engines import placements_here
    from mirror_rt.devices.registry import format_devices

    print(format_devices())
    print("\n".join(f"placement, {line}" for line in placements_here()))
    if not args.check:
        return 0
    from mirror_rt.evaluation.device_check import format_check, run_check, write_check

    models = args.models.split(",") if args.models else None
    doc = run_check(models, args.max_new_tokens, args.compile, log=log)
    print(format_check(doc))
    print(f"written to {write_check(doc, args.out)}")
    return 0


def cmd_run(args) -> int:
    from mirror_rt.devices.engines import load_engine

    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("no prompt: pass it as an argument or on stdin")
        prompt = sys.stdin.read()
    options = dict(mode=args.mode, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                   seed=args.seed, stop_strings=tuple(args.stop), branch_budget=args.branch_budget,
                   early_exit=args.early_exit, draft_lookup=args.draft_lookup, constraint=run_constraint(args))
    from mirror_rt.runtime.config import make_config

    config = make_config(**options)  # validate before loading anything
    engine = load_engine(args.bundle, torch=args.torch, torch_options=torch_options(args), mode=config.mode,
                         **bundle_options(args))
    gen = engine.stream(prompt, config, chat=not args.no_chat)
    try:
        for piece in gen:
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        gen.pieces.close()
        print("\n[interrupted]", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({"text": gen.text, "stats": gen.stats}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if args.stats:
            print(format_stats(gen.stats), file=sys.stderr)
    return 0


def run_constraint(args):
    """The grammar `--json-schema FILE` or `--regex RE` asks for (None when neither)."""
    from mirror_rt.runtime.grammar import Constraint

    if args.json_schema and args.regex:
        raise ValueError("--json-schema and --regex both constrain the output: give one")
    if args.regex:
        return Constraint("regex", args.regex)
    if not args.json_schema:
        return None
    with open(args.json_schema) as file:
        text = file.read()
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--json-schema {args.json_schema}: not JSON ({exc})") from None
    return Constraint("json_schema", text)


def torch_options(args) -> dict:
    """The torch-only options of `run` / `serve` (None where not given or not offered: they choose no engine)."""
    return {name: getattr(args, name, None) for name in TORCH_OPTIONS}


def bundle_options(args) -> dict:
    """Bundle placement and cache options of `run` / `serve`, as `load_engine` takes them."""
    return dict(target_device=args.target, draft_device=args.draft, draft_bundle=args.draft_bundle,
                strict_devices=args.strict_devices, draft_precision=args.draft_precision, cache_dir=args.cache_dir)


def format_stats(stats: dict) -> str:
    """Human-readable stats block."""
    acc = " ".join(f"{a:.2f}" for a in stats.get("acceptance_per_position", []))
    lines = [
        (f"mode {stats['mode']}: {stats['new_tokens']} tokens in {stats['wall_time_s']:.2f} s = "
         f"{stats['tokens_per_s']:.1f} tokens/s (decode {stats['decode_tokens_per_s']:.1f} tokens/s, "
         f"first token {stats['time_to_first_token_s'] * 1000:.0f} ms)"),
        f"steps {stats['steps']}, mean accepted length {stats['mean_accepted_length']:.2f} tokens per target forward",
    ]
    if acc:
        lines.append(f"acceptance per position: {acc}")
    if stats.get("draft"):
        lines.append(f"draft: {stats['draft']}")
    if stats.get("target_precision"):
        lines.append(f"path: {stats.get('path', '?')}, target {stats['target_precision']}"
                     + (f", draft {stats['draft_precision']}" if stats.get("draft_precision") else ""))
    if stats.get("placement"):
        lines.append(f"placement: {stats['placement']}")
    if stats.get("device_reads_per_step"):
        lines.append(f"device->host {stats['device_to_host_bytes_per_token']:.0f} bytes per token, "
                     f"{stats['device_reads_per_step']:.2f} reads (syncs) per step")
    if "reuse_hit_rate" in stats:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in stats["phase_ms_per_step"].items())
        lines.append(f"reuse hit rate {stats['reuse_hit_rate']:.2f} (main {stats['main_line_hits']}, side "
                     f"{stats['side_branch_hits']}, wrong {stats['misses']}, not ready {stats['not_ready']}); "
                     f"early-exit coverage {stats['early_exit_coverage']}; hidden draft share "
                     f"{stats['hidden_draft_share']:.2f}")
        lines.append(f"draft forwards per token {stats['draft_forwards_per_token']:.2f}; prompt-lookup guesses "
                     f"kept {stats['lookup_guesses_kept']}")
        lines.append(f"ms per step: {phases}; latency model {stats['predicted_step_ms']:.1f} ms predicted "
                     f"(pipelined form {stats['predicted_step_ms_pipelined']:.1f}), "
                     f"{stats['measured_step_ms']:.1f} ms measured")
    for event in stats.get("events", []):
        lines.append(f"event: {event}")
    lines.append(f"stop: {stats['stop_reason']}")
    return "\n".join(lines)


def _one_line_warnings() -> None:
    """Device fallbacks and other runtime warnings as one line each: `mirror-rt: warning: ...`."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"mirror-rt: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def main(argv=None) -> int:
    from mirror_rt.models.default_model import DefaultModelUnavailable

    parser = build_parser()
    args = parser.parse_args(argv)
    _one_line_warnings()
    try:
        commands = {"run": cmd_run, "simulate": cmd_simulate, "export": cmd_export, "devices": cmd_devices,
                    "serve": cmd_serve, **BENCH_COMMANDS, **TRAINING_COMMANDS}
        return commands[args.command](args)
    except KeyboardInterrupt:
        print("\nmirror-rt: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, DefaultModelUnavailable) as exc:
        print(f"mirror-rt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
