"""Per-request decoding settings: one frozen dataclass, validated on construction, the one home of each.

Every setting has one name from flag to field, one default and one validation, here. Load-time settings live in
`devices.options`. Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirror_rt.runtime.sampling import SamplingConfig
from mirror_rt.runtime.token_rules import RulesConfig
from mirror_rt.runtime.values import is_integer, is_number

MODES = ("ar", "sd", "mirror")
EARLY_EXIT = ("auto", "on", "off")
SAMPLING_VERIFY = ("rejection", "exact-seed")  # runtime.acceptance: how a sampled window is verified
MAX_GAMMA = 64  # the longest window a request may ask for


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how."""

    max_new_tokens: int = 256  # upper bound on generated tokens
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # temperature, top-k, top-p
    gamma: int = 4  # draft tokens per window (the most; Mirror adapts its window in 1..gamma)
    mode: str | None = None  # ar (target only) | sd (vanilla speculative) | mirror; None: the engine's default
    seed: int = 0  # seeds every random draw of a request
    stop_strings: tuple[str, ...] = ()  # generation stops before the first occurrence of any
    ignore_eos: bool = False  # keep going past end-of-sequence tokens (benchmarks)
    branch_budget: int | None = None  # mirror: side branches per step; None = auto (as many as fit)
    min_window: int = 1  # mirror: send a precomputed window once it has this many tokens
    draft_timeout_s: float = 10.0  # mirror: a draft silent this long is declared dead
    early_exit: str = "auto"  # mirror: on | off | auto (off while the draft is the bottleneck)
    draft_lookup: int = 3  # mirror, greedy: prompt-lookup guesses the draft checks per forward (0 = off)
    # sd, mirror under sampling: rejection (standard speculative sampling: the target's distribution, more tokens
    # accepted) | exact-seed (the same text as target-only for a seed, fewer accepted); greedy: argmax either way
    sampling_verify: str = "rejection"
    rules: RulesConfig = field(default_factory=RulesConfig)  # grammar, logit bias, penalties, logprobs

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name, value in (("max_new_tokens", self.max_new_tokens), ("gamma", self.gamma), ("seed", self.seed),
                            ("min_window", self.min_window), ("draft_lookup", self.draft_lookup)):
            if not is_integer(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if isinstance(self.stop_strings, str):
            raise ValueError(f"stop_strings must be a list of strings, got the string {self.stop_strings!r}")
        if not isinstance(self.stop_strings, tuple) or not all(isinstance(s, str) for s in self.stop_strings):
            raise ValueError(f"stop_strings must be a list of strings, got {self.stop_strings!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.branch_budget is not None and not is_integer(self.branch_budget):
            raise ValueError(f"branch_budget must be 'auto' or an integer >= 0, got {self.branch_budget!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if not is_number(self.draft_timeout_s):
            raise ValueError(f"draft_timeout_s must be a number of seconds, got {self.draft_timeout_s!r}")
        if not -(2**63) <= self.seed < 2**63:  # an int64, as the server takes it (it wrapped modulo 2**64)
            raise ValueError(f"--seed must be in -2**63..2**63-1, got {self.seed}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not 1 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"--gamma must be in 1..{MAX_GAMMA}, got {self.gamma}")
        if self.branch_budget is not None and self.branch_budget < 0:
            raise ValueError(f"--branch-budget must be 'auto' or >= 0, got {self.branch_budget}")
        if self.early_exit not in EARLY_EXIT:
            raise ValueError(f"--early-exit must be on, off or auto, got {self.early_exit!r}")
        if self.sampling_verify not in SAMPLING_VERIFY:
            raise ValueError(f"--sampling-verify must be rejection or exact-seed, got {self.sampling_verify!r}")
        if self.draft_lookup < 0:
            raise ValueError(f"--draft-lookup must be >= 0, got {self.draft_lookup}")
        if self.draft_timeout_s <= 0:
            raise ValueError(f"draft timeout must be positive, got {self.draft_timeout_s}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")

    @property
    def rejection_sampling(self) -> bool:
        """Whether windows are verified by standard speculative sampling (the draft then sends its q rows)."""
        return self.sampling_verify == "rejection" and not self.sampling.greedy


DEFAULTS = GenerationConfig()  # every default, read by the CLI's flags and the other entry points


def make_config(base: GenerationConfig | None = None, **options) -> GenerationConfig:
    """A GenerationConfig from keyword options; sampling fields may be given flat.

    Example: make_config(max_new_tokens=64, temperature=0.7, top_p=0.9, mode="ar"); the fields of
    RulesConfig too: make_config(constraint=Constraint.json_schema(schema), logit_bias={42: -100}, logprobs=5).
    """
    import dataclasses

    if base is not None and not isinstance(base, GenerationConfig):
        raise ValueError(f"config must be a GenerationConfig (or give settings as keywords), got {type(base).__name__}")
    base = base or GenerationConfig()
    sampling_fields = {f.name for f in dataclasses.fields(SamplingConfig)}
    sampling = {k: options.pop(k) for k in list(options) if k in sampling_fields}
    rules_fields = {f.name for f in dataclasses.fields(RulesConfig)}
    rules = {k: options.pop(k) for k in list(options) if k in rules_fields}
    known = {f.name for f in dataclasses.fields(GenerationConfig)}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    if options.get("branch_budget") == "auto":  # the CLI's and the docs' word for None
        options["branch_budget"] = None
    if "stop_strings" in options:
        stop = options["stop_strings"]
        if stop is None:
            options["stop_strings"] = ()
        elif isinstance(stop, (list, tuple)):  # a string, or anything else: validate refuses it in one line
            options["stop_strings"] = tuple(stop)
    if sampling:
        options["sampling"] = dataclasses.replace(base.sampling, **sampling)
    if rules:
        if isinstance(rules.get("logit_bias"), dict):
            rules["logit_bias"] = tuple((int(i), float(b)) for i, b in rules["logit_bias"].items())
        options["rules"] = dataclasses.replace(base.rules, **rules)
    return dataclasses.replace(base, **options)
