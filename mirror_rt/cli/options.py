"""The option groups `run`, `serve` and `bench` share: each flag named as its settings field, its default read there.

Engine options (`EngineConfig`), decoding options (`GenerationConfig`: for a server, the defaults of requests that
name none) and request options (`run`, `bench`). `engine_config(args)` and `generation_config(args)` build the
settings from the parsed flags by field name; `%(default)s` in a help text is the settings object's default.
"""

from __future__ import annotations

import argparse
import os
import sys

from mirror_rt.devices.options import BUNDLE_WEIGHTS, DRAFT_PRECISIONS, EngineConfig, flag_names
from mirror_rt.models.config import DEFAULT_KAPPA
from mirror_rt.models.default_model import DEFAULT_MODEL
from mirror_rt.runtime.config import DEFAULTS, EARLY_EXIT, MAX_GAMMA, MODES, SAMPLING_VERIFY, make_config

# --- argument types and the log line of every subcommand ---------------------------------------

def whole(text: str, minimum: int, expected: str = "a whole number") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole(text, 1)


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None


def positive_number(text: str) -> float:
    value = number(text)
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got '{text}'")
    return value


def port_number(text: str) -> int:
    value = whole(text, 1, "a port number")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1..65535), got {value}")
    return value


def count(text: str) -> int:
    return whole(text, 0)


def budget(text: str) -> int | None:
    return None if text == "auto" else whole(text, 0, "'auto' or a whole number")


def output_folder(text: str) -> str:
    """A folder to write into: refused at once (not after the work) when it cannot be."""
    return _writable(text, folder=True)


def output_file(text: str) -> str:
    """A file to write: refused at once (not after the work) when it cannot be."""
    return _writable(text, folder=False)


def _writable(text: str, folder: bool) -> str:
    from mirror_rt.exporters.paths import OutputPathError, check_writable

    if os.path.exists(text) and folder and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    try:
        check_writable(text, folder=folder)
    except OutputPathError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the option groups ------------------------------------------------------------------------

ENGINE = EngineConfig()
# What each engine flag says (every EngineConfig field but the API-only `pin`).
ENGINE_HELP = {
    "model": f"target: HF folder, .gguf file or preset (default: {DEFAULT_MODEL}); a .gguf file or a "
             "folder over 1 GB runs as a bundle exported once into the cache, a smaller folder or a preset in torch "
             "eager",
    "draft_model": "torch draft: int8 (an int8 copy of the target, default), target (oracle draft), or an HF "
                   "folder, .gguf file or preset",
    "draft_streams": "trained SS streams (mirror-rt train-draft --out) over the draft",
    "bundle": "run an exported bundle (mirror-rt export) instead of --model (default model: its ONNX bundle, "
              "exported once into the cache)",
    "draft_bundle": "take the draft from another bundle (default: --bundle's)",
    "torch": "run the default model in torch eager, not its ONNX bundle",
    "cache_dir": "model cache folder (default: $MIRROR_RT_CACHE, else $XDG_CACHE_HOME/mirror-rt, else "
                 "~/.cache/mirror-rt)",
    "target": "target device (default %(default)s): cpu, cuda, cuda:1, gpu, npu, openvino:CPU, ort:cpu, ort:qnn, "
              "torch:cpu...; without --bundle, cuda runs the target in torch on the GPU",
    "draft": "draft device (default %(default)s: where more than one device runs the draft, each is timed at load "
             "and the latency model picks, no speculation included; same forms; the default bundle's draft, or "
             "--draft-bundle's, with a CUDA target)",
    "weights": "the default model's target precision (default: fp32): its bundle at these weights, exported once "
               "into the cache (int8 | int4 | q4_1: the GGUF's own blocks | w8a8: int8 weights and activations, "
               "fastest in batches; docs/performance.md)",
    "strict_devices": "fail instead of falling back to a CPU backend",
    "device": ("torch device of the target: cpu (default), cuda, cuda:1; one torch cannot see is an error, where "
               "--target falls back to the CPU with a warning"),
    "threads": "torch threads (default: all cores)",
    "dtype": "torch target dtype: bf16 on CUDA (fp16 without bf16), else fp32 by default; float32 | bfloat16 | "
             "float16 | float64 (or fp32, bf16, fp16)",
    "draft_precision": "OpenVINO draft compute precision (bf16: faster on bf16 CPUs; the output never changes, "
                       "only acceptance)",
    "compile": "torch: static-shape windows under torch.compile (CUDA graphs on CUDA, inductor on CPU)",
    "exit_layer": "torch: early-exit layer (mirror; default N/2)",
    "kappa": f"torch: early-exit candidates per position (mirror; default {DEFAULT_KAPPA})",
    "max_num_seqs": "sequences decoded at once (default %(default)s): more wait, up to --max-queued",
    "kv_cache_gb": "KV memory of both models' rows and the prefix cache, in GiB (2**30 bytes; default: 4, or every "
                   "row at full length where that takes less; docs/serving.md: sizing it)",
    "prefill_chunk": "prompt tokens prefilled per step, several short prompts or a chunk of a long one (default "
                     "%(default)s): prompts stall the running requests by one chunk at most",
    "prefix_cache": "keep full 16-token blocks of finished requests for later ones that share them (default: on)",
    "prefix_cache_share": "the most of the KV budget the prefix cache keeps, 0..1 (default %(default)s; it gives "
                          "its blocks up to requests)",
    "adaptive_speculation": "speculate only while it pays at this load: draft windows per batch size from the step "
                            "costs measured, down to target-only steps (default: on)",
}
BATCH = ("max_num_seqs", "kv_cache_gb", "prefill_chunk", "prefix_cache", "prefix_cache_share",
         "adaptive_speculation")  # serve's
ENGINE_TYPES = {"threads": positive_int, "exit_layer": positive_int, "kappa": positive_int,
                "max_num_seqs": positive_int, "kv_cache_gb": positive_number, "prefill_chunk": positive_int,
                "prefix_cache_share": positive_number}
ON_OFF = ("prefix_cache", "adaptive_speculation")  # --name / --no-name
ENGINE_CHOICES = {"draft_precision": DRAFT_PRECISIONS, "weights": BUNDLE_WEIGHTS}
SWITCHES = ("torch", "strict_devices", "compile")  # flags without a value
# The decoding and request options, by field name (sampling fields are SamplingConfig's, given flat).
DECODING = ("gamma", "branch_budget", "draft_lookup", "early_exit", "sampling_verify")
REQUEST = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_strings")


def add_engine_options(parser, names=tuple(n for n in ENGINE_HELP if n not in BATCH)) -> None:
    """The engine flags among `names` (default: all but the batch's, `serve`'s), EngineConfig's defaults."""
    values = {name: value for part in vars(ENGINE).values() for name, value in vars(part).items()}
    parser = parser.add_argument_group("engine: what runs where (devices.options.EngineConfig)")
    for name in names:
        flag = "--" + name.replace("_", "-")
        if name in ON_OFF:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=values[name],
                                help=ENGINE_HELP[name])
        elif name in SWITCHES:  # store_true; compile stays None when not given (a torch-only option)
            parser.add_argument(flag, action="store_true", default=values[name], help=ENGINE_HELP[name])
        else:
            parser.add_argument(flag, type=ENGINE_TYPES.get(name), choices=ENGINE_CHOICES.get(name),
                                default=values[name], help=ENGINE_HELP[name])


def add_decoding_options(parser, mode: bool = True) -> None:
    """The decoding flags, `--mode` unless `mode` is False (the bench's methods name theirs)."""
    parser = parser.add_argument_group("decoding (runtime.config.GenerationConfig)")
    if mode:
        parser.add_argument("--mode", default=DEFAULTS.mode, help=f"decoding mode: {', '.join(MODES)} (default: the "
                            "engine's, mirror where the target is split at its early exit, as every bundle's is)")
    parser.add_argument("--gamma", type=positive_int, default=DEFAULTS.gamma,
                        help=f"draft tokens per window, at most {MAX_GAMMA} (default %(default)s)")
    parser.add_argument("--branch-budget", type=budget, default=DEFAULTS.branch_budget,
                        help="mirror: side branches precomputed per step: auto (default: as many as fit) or N")
    parser.add_argument("--draft-lookup", type=count, default=DEFAULTS.draft_lookup,
                        help="mirror, greedy: prompt-lookup guesses the draft checks per forward "
                             "(default %(default)s; 0: off)")
    parser.add_argument("--early-exit", default=DEFAULTS.early_exit, choices=EARLY_EXIT,
                        help="mirror: send early-exit candidates (default %(default)s: only while the draft has "
                             "time to use them)")
    parser.add_argument("--sampling-verify", default=DEFAULTS.sampling_verify, choices=SAMPLING_VERIFY,
                        help="sd, mirror under sampling: rejection (default: standard speculative sampling, the "
                             "target's distribution, more tokens accepted) or exact-seed (target-only's very text "
                             "for a seed, fewer accepted)")


def add_request_options(parser) -> None:
    """How much to generate and how to sample: GenerationConfig (and SamplingConfig) fields with their defaults."""
    parser = parser.add_argument_group("request: how much and how to sample (GenerationConfig, SamplingConfig)")
    sampling = DEFAULTS.sampling
    parser.add_argument("--max-new-tokens", type=positive_int, default=DEFAULTS.max_new_tokens,
                        help="tokens to generate at most (default %(default)s)")
    parser.add_argument("--temperature", type=number, default=sampling.temperature,
                        help="0 = greedy (default %(default)s)")
    parser.add_argument("--top-p", type=number, default=sampling.top_p, help="nucleus sampling (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=sampling.top_k, help="0 = off (default %(default)s)")
    parser.add_argument("--min-p", type=number, default=sampling.min_p,
                        help="keep tokens at least this share of the likeliest one's probability; 0 = off "
                             "(default %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seeds every draw (default %(default)s)")
    parser.add_argument("--stop-strings", "--stop", action="append", default=list(DEFAULTS.stop_strings),
                        help="stop before this string (repeatable)")


def engine_config(args, **given) -> EngineConfig:
    """The EngineConfig of parsed flags (those a parser lacks keep their defaults); `given` overrides."""
    values = {name: getattr(args, name) for name in flag_names() if hasattr(args, name)}
    return EngineConfig.from_flags(**(values | given))


def generation_config(args):
    """The GenerationConfig of parsed decoding and request flags (validated: a bad value is one line)."""
    names = ("mode",) + DECODING + REQUEST
    return make_config(**{name: getattr(args, name) for name in names if hasattr(args, name)})
