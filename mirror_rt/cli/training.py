"""`mirror-rt train-draft`, `train-exit`, `prune-vocab` and `eval-draft`: parsers and commands."""

from __future__ import annotations

import json

from mirror_rt.cli.options import count, log, positive_int, positive_number
from mirror_rt.runtime.config import DEFAULTS

DATA_HELP = ("SpecBench-format jsonl question files, or a set shipped with mirror-rt by name: specbench-dev "
             "(SpecBench's dev questions), short-prompts")
TARGET_HELP = "target model (default: SmolLM2-135M-Instruct)"


def add_training(sub) -> None:
    draft = sub.add_parser("train-draft", help="train Speculative Streaming streams for a draft (distillation)")
    draft.add_argument("--target", help=TARGET_HELP)
    draft.add_argument("--init", default="self", help="the draft: self (the target), layers:K, or a model path")
    draft.add_argument("--streams", type=positive_int, default=2, help="lookahead streams")
    draft.add_argument("--stream-layers", type=positive_int, default=2, help="top layers with streams")
    draft.add_argument("--rank", type=positive_int, default=16, help="LoRA rank of the stream rows")
    draft.add_argument("--data", nargs="+", required=True, help=DATA_HELP)
    draft.add_argument("--steps", type=positive_int, default=300)
    draft.add_argument("--lr", type=positive_number, default=2e-3, help="learning rate (default %(default)s)")
    draft.add_argument("--seed", type=int, default=0)
    draft.add_argument("--cache-dir")
    draft.add_argument("--out", required=True, help="folder for streams.safetensors / streams.json (resumes)")
    exit_ = sub.add_parser("train-exit", help="train an early-exit adapter (an attention read of the exit layer's "
                           "keys + a low-rank map) distilled from the final layer")
    exit_.add_argument("--target", help=TARGET_HELP)
    exit_.add_argument("--exit-layer", type=positive_int, help="default N/2")
    exit_.add_argument("--rank", type=positive_int, help="adapter rank (default: 512, or the model's hidden size "
                       "where smaller)")
    exit_.add_argument("--no-attention", dest="attention", action="store_false",
                       help="per-position low-rank map only (no read of earlier positions; weaker)")
    exit_.add_argument("--data", nargs="+", required=True, help=DATA_HELP)
    exit_.add_argument("--steps", type=positive_int, default=600)
    exit_.add_argument("--seed", type=int, default=0)
    exit_.add_argument("--out", help="adapter path (default: in the cache)")
    prune = sub.add_parser("prune-vocab", help="keep the target's most frequent tokens for a draft's LM head")
    prune.add_argument("--target", help=TARGET_HELP)
    prune.add_argument("--data", nargs="+", required=True, help=DATA_HELP)
    prune.add_argument("--size", type=positive_int, required=True, help="token ids to keep")
    prune.add_argument("--out", required=True, help="kept-ids file to write (.json; mirror-rt export --draft-vocab)")
    prune.add_argument("--cache-dir")
    evaluate = sub.add_parser("eval-draft", help="bundles' drafts on held-out target text: acceptance per position, "
                              "mean accepted length, forwards and ms per window, side by side")
    evaluate.add_argument("--bundle", action="append", required=True, help="a bundle (repeat to compare; "
                          "the first is the reference of `rollout vs first`)")
    evaluate.add_argument("--target",
                          help="target model whose greedy answers are the text (default: SmolLM2-135M-Instruct)")
    evaluate.add_argument("--data", nargs="+", required=True, help=DATA_HELP)
    evaluate.add_argument("--gamma", type=positive_int, action="append",
                          help="window length (repeatable; default 4 and 7)")
    evaluate.add_argument("--questions", type=positive_int, default=24, help="held-out questions (default 24)")
    evaluate.add_argument("--stride", type=positive_int, default=8, help="answer tokens between window starts")
    evaluate.add_argument("--draft-lookup", type=count, default=DEFAULTS.draft_lookup,
                          help="prompt-lookup guesses per forward, as in run (default %(default)s; 0: off)")
    evaluate.add_argument("--oracle-streams", action="store_true", help="also run SS drafts with the text as "
                          "their stream guesses: what perfect streams would cost here")
    evaluate.add_argument("--json", action="store_true")
    evaluate.add_argument("--cache-dir")


def cmd_train_draft(args) -> int:
    from mirror_rt.training.ss_training import train_draft_main

    report = train_draft_main(args.target, args.init, args.streams, args.stream_layers, args.rank, args.data,
                              args.steps, args.out, args.seed, args.lr, cache=args.cache_dir, log=log)
    print(json.dumps(report, indent=2))
    return 0


def cmd_prune_vocab(args) -> int:
    from mirror_rt.training.vocab_prune import prune_vocab_main

    report = prune_vocab_main(args.target, args.data, args.size, args.out, cache=args.cache_dir)
    print(json.dumps(report, indent=2))
    return 0


def cmd_eval_draft(args) -> int:
    from mirror_rt.training.draft_eval import eval_draft_main, format_rows

    gammas = tuple(dict.fromkeys(args.gamma or (4, 7)))  # a gamma given twice made a second row of it
    rows = eval_draft_main(args.bundle, args.target, args.data, gammas, args.questions,
                           args.stride, cache=args.cache_dir, oracle_streams=args.oracle_streams,
                           draft_lookup=args.draft_lookup)
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
    return 0


def cmd_train_exit(args) -> int:
    from mirror_rt.training.exit_training import train_exit_main

    report = train_exit_main(args.target, args.exit_layer, args.data, args.steps, args.rank, args.out, args.seed,
                             attention=args.attention)
    print(json.dumps(report, indent=2))
    return 0


COMMANDS = {"train-draft": cmd_train_draft, "train-exit": cmd_train_exit, "prune-vocab": cmd_prune_vocab,
            "eval-draft": cmd_eval_draft}
