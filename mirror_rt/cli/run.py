"""`mirror-rt run`, `export`, `devices` and `simulate`: parsers and commands (the work is in the code folders)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from mirror_rt.cli import signals
from mirror_rt.cli.options import (
    add_decoding_options,
    add_engine_options,
    add_request_options,
    engine_config,
    generation_config,
    log,
    positive_int,
)
from mirror_rt.evaluation.device_check import CHECK_OUT, CHECK_TOKENS, MAX_CHECK_TOKENS
from mirror_rt.exporters.export_config import ATTENTION, KV_DTYPES, ExportConfig
from mirror_rt.exporters.paths import check_writable
from mirror_rt.models.config import DEFAULT_KAPPA
from mirror_rt.models.default_model import DEFAULT_MODEL

EXPORT = ExportConfig(model=None, out_dir=".")  # the export defaults, read by the flags


def add_run(sub) -> None:
    run = sub.add_parser("run", help="generate text for a prompt (argument or stdin)")
    run.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted (without a byte-order "
                     "mark and the one line end that ends it)")
    add_engine_options(run)
    add_decoding_options(run)
    add_request_options(run)
    run.add_argument("--json-schema", metavar="FILE", help="constrain the output to the JSON schema in FILE")
    run.add_argument("--regex", help="constrain the output to match this regular expression")
    run.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    run.add_argument("--stats", action="store_true", help="print speed and acceptance statistics (stderr)")
    run.add_argument("--json", action="store_true", help="print one JSON object with text and stats")


def cmd_run(args) -> int:
    from mirror_rt.devices.engines import load_engine
    from mirror_rt.runtime.metrics import format_stats

    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("no prompt: pass it as an argument or on stdin")
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as exc:  # (Python's own reading made it "a lone surrogate at index 0")
            raise ValueError(f"stdin is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}") from None
        prompt = stdin_text(prompt)
    config = generation_config(args)  # validate before loading anything
    constraint = run_constraint(args)
    if constraint is not None:
        config = replace(config, rules=replace(config.rules, constraint=constraint))
    engine = load_engine(engine_config(args, max_num_seqs=1), config.mode)  # one prompt: one KV row
    if not args.no_chat and not engine.tokenizer.has_chat_template:
        print("mirror-rt: note: the model has no chat template; the prompt goes in as plain text (as --no-chat)",
              file=sys.stderr)
    gen = engine.stream(prompt, config, chat=not args.no_chat)
    written = False
    try:
        read_prompt(engine, gen)
        for piece in gen:
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
                written = written or bool(piece)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (signals.Terminated)
        gen.pieces.close()
        if args.json:  # what was generated, as a finished run prints it (its stop reason says it was cut)
            stats = gen.stats or {"new_tokens": len(gen.sequence.tokens), "stop_reason": "cancelled"}
            print(json.dumps({"text": gen.text, "stats": stats}, ensure_ascii=False))
        signals.say_stopped(signals.signal_of(exc), after_text=written)
        return signals.exit_code(exc)
    if args.json:
        print(json.dumps({"text": gen.text, "stats": gen.stats}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if args.stats:
            print(format_stats(gen.stats), file=sys.stderr)
    return 0


PROGRESS_FROM = 2048  # prompt tokens from which `run` shows its reading (8,000 tokens take about a minute here)


def stdin_text(text: str) -> str:
    """A prompt read from stdin as given as an argument: no byte-order mark, no final line end."""
    text = text.removeprefix("\ufeff")
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def read_prompt(engine, gen) -> None:
    """A long prompt's reading as a progress bar on stderr (the answer starts only after it); nothing for others."""
    seq = gen.sequence
    if len(seq.prompt) < PROGRESS_FROM:
        return
    from tqdm import tqdm

    with tqdm(total=len(seq.prompt), desc="reading the prompt", unit="tok", leave=False, file=sys.stderr) as bar:
        while seq.state in ("waiting", "prefill") and not gen.finished:
            engine.step()
            bar.update(min(seq.computed, len(seq.prompt)) - bar.n)


def run_constraint(args):
    """The grammar `--json-schema FILE` or `--regex RE` asks for (None when neither)."""
    if args.json_schema is not None and args.regex is not None:
        raise ValueError("--json-schema and --regex both constrain the output: give one")
    if args.json_schema is None and args.regex is None:
        return None
    from mirror_rt.runtime.grammar import Constraint

    if args.regex is not None:  # '' too: it allows the empty answer only (it was dropped: free text)
        return Constraint("regex", args.regex)
    try:
        with open(args.json_schema, encoding="utf-8") as file:
            text = file.read()
        json.loads(text)
    except OSError as exc:  # missing, a folder, unreadable
        raise ValueError(f"--json-schema {args.json_schema}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--json-schema {args.json_schema}: not JSON ({exc})") from None
    return Constraint("json_schema", text)


def add_export(sub) -> None:
    export = sub.add_parser("export", help="split a model into target prefix / suffix and draft graphs (a bundle)")
    export.add_argument("--model", default=EXPORT.model, help="target: HF folder, .gguf file or preset (default: "
                        f"{DEFAULT_MODEL})")
    export.add_argument("--draft-model", default=EXPORT.draft_model,
                        help="draft model (default: the target itself, with --draft-weights)")
    export.add_argument("--draft", dest="draft_device_spelling", help=argparse.SUPPRESS)  # refused: --draft-model
    export.add_argument("--exit-layer", type=positive_int, default=EXPORT.exit_layer,
                        help="early-exit layer (default N/2)")
    export.add_argument("--kappa", type=positive_int, default=EXPORT.kappa,
                        help=f"early-exit candidates per position (default {DEFAULT_KAPPA})")
    export.add_argument("--draft-streams", help="trained SS streams (mirror-rt train-draft --out) exported in the "
                        "draft graph (onnx); Mirror's greedy rollouts then confirm several tokens per forward")
    export.add_argument("--format", dest="fmt", default=EXPORT.fmt,
                        help="onnx (default: exact and fastest on CPU here) | openvino | torch")
    export.add_argument("--weights", default=EXPORT.weights,
                        help="target weights: fp32 (default, as the default bundle's) | fp16 (openvino, torch) | "
                        "int8 | int4 | q4_1 | w8a8 (onnx: int8 activations per row; docs/performance.md)")
    export.add_argument("--draft-weights", default=EXPORT.draft_weights,
                        help="draft weights: auto (default: q4_1 where the weights are Q4_1 blocks exactly and the "
                        "format is onnx, fp32 for torch, else int8) | fp32 | fp16 | int8 | int4 | q4_1 (onnx: 4-bit "
                        "blocks with a minimum, exact for Q4_1 GGUF weights such as the default model's) | w8a8 (onnx)")
    export.add_argument("--exit-weights", default=EXPORT.exit_weights, help="early-exit head weights: fp32 | int8 "
                        "(default %(default)s: it only ranks draft branches, never changes the output)")
    export.add_argument("--exit-adapter", help="a trained exit adapter (mirror-rt train-exit) to carry")
    export.add_argument("--kv", help="shared (default with onnx: KV written in place, no copy per call; ONNX "
                        "Runtime only) | explicit (KV in and out: OpenVINO can load the .onnx too)")
    export.add_argument("--attention", choices=ATTENTION, help="the target's attention with --kv shared: pool "
                        "(mirror-rt's ONNX Runtime op reads the KV in place; built with the machine's C++ compiler, "
                        "here and wherever the bundle runs) | standard (standard ONNX ops); default: pool where it "
                        "builds")
    export.add_argument("--kv-dtype", choices=KV_DTYPES, help="the target's KV with --attention pool: fp16 (half "
                        "the memory and the reads of attention) | fp32; default: fp16 for --weights w8a8, else fp32")
    export.add_argument("--draft-vocab", help="kept token ids (mirror-rt prune-vocab --out): the draft's LM head "
                        "over those rows only, -inf elsewhere (onnx, openvino; the output never changes)")
    export.add_argument("--static", action="store_true", help="fixed shapes (NPUs need them)")
    export.add_argument("--max-context", type=positive_int, help="context limit of the bundle")
    export.add_argument("--max-window", type=positive_int, help="window limit (with --static)")
    export.add_argument("--out", dest="out_dir", required=True, help="bundle folder to write")


def cmd_export(args) -> int:
    from dataclasses import fields
    from pathlib import Path

    from mirror_rt.exporters.export import run_export

    if args.draft_device_spelling is not None:
        raise ValueError("export --draft is now --draft-model (the draft model; --draft names the draft's device "
                         "in run and serve)")
    if not args.out_dir.strip():  # Path("") is the current folder
        raise ValueError("--out is empty: name the bundle's folder")
    config = ExportConfig(**{f.name: getattr(args, f.name) for f in fields(ExportConfig)} | {
        "out_dir": Path(args.out_dir)})
    folder = run_export(config)
    print(f"bundle written to {folder}")
    if args.exit_adapter is None:
        print("early exit: untrained; `mirror-rt train-exit` (about 20 min on 2 CPU cores) trains an adapter "
              "that `--exit-adapter` then carries")
    return 0


def add_devices(sub) -> None:
    devices = sub.add_parser("devices", help="list the devices each backend sees here and where run places its workers")
    devices.add_argument("--check", action="store_true", help="run every device pair found here (random-weight "
                         "SmolLM2 presets, offline): equality, tokens/s, device reads, launches, peak memory")
    devices.add_argument("--models", help="presets to check (default: smollm2-135m, plus smollm2-1.7b with CUDA)")
    devices.add_argument("--max-new-tokens", type=positive_int,
                         help=f"tokens per run of the check (default {CHECK_TOKENS}, at most {MAX_CHECK_TOKENS})")
    devices.add_argument("--compile", action="store_true", help="check the compiled path (torch.compile) instead")
    devices.add_argument("--out", help=f"JSON file the check writes (default {CHECK_OUT})")


def cmd_devices(args) -> int:
    from mirror_rt.devices.engines import draft_choice_here, placements_here
    from mirror_rt.devices.registry import format_devices

    given = [flag for flag, value in (("--models", args.models), ("--max-new-tokens", args.max_new_tokens),
                                      ("--compile", args.compile or None), ("--out", args.out)) if value is not None]
    if given and not args.check:
        raise ValueError(f"{', '.join(given)}: only with --check")
    max_new_tokens = args.max_new_tokens or CHECK_TOKENS
    if max_new_tokens > MAX_CHECK_TOKENS:
        raise ValueError(f"--max-new-tokens of the check must be at most {MAX_CHECK_TOKENS}, got {max_new_tokens}")
    models = check_models(args.models)
    out = check_writable(CHECK_OUT if args.out is None else args.out, folder=False) if args.check else None
    print(format_devices())
    print("\n".join(f"placement, {line}" for line in placements_here()))
    print("\n".join(draft_choice_here()))
    if not args.check:
        return 0
    from mirror_rt.evaluation.device_check import format_check, run_check, write_check

    doc = run_check(models, max_new_tokens, args.compile, log=log)
    print(format_check(doc))
    print(f"written to {write_check(doc, out)}")
    return 0


def check_models(given: str | None) -> list[str] | None:
    """`--models a,b` -> ["a", "b"] (None: the check's defaults); an empty name is refused, not read as none."""
    if given is None:
        return None
    models = [name.strip() for name in given.split(",")]
    if not all(models):
        raise ValueError(f"--models takes presets separated by commas (e.g. smollm2-135m), got {given!r}")
    return models


def add_simulate(sub) -> None:
    simulate = sub.add_parser("simulate", help="predict AR / SD / Mirror speed from costs (latency model)")
    simulate.add_argument("--config", default="qwen3-14b-m2ultra",
                          help="a JSON file of costs and rates, or a preset (default: the paper's setting)")
    simulate.add_argument("--json", action="store_true")


def cmd_simulate(args) -> int:
    from mirror_rt.evaluation.simulate import format_prediction, load_config, predict

    cfg = load_config(args.config)
    result = predict(cfg)
    if args.json:
        print(json.dumps({"config": cfg.__dict__, "prediction": result}, indent=2))
    else:
        print(format_prediction(cfg, result))
    return 0


COMMANDS = {"run": cmd_run, "export": cmd_export, "devices": cmd_devices, "simulate": cmd_simulate}


def add_commands(sub) -> None:
    add_run(sub)
    add_export(sub)
    add_devices(sub)
    add_simulate(sub)
