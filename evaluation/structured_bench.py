"""Structured output measured: 8 prompts asking for JSON of one of 3 schemas (named in the prompt either way), in
every mode asked for, constrained by the grammar and not, interleaved prompt by prompt. Per row: tokens/s (with and
without the prompt's prefill), mean accepted length, draft acceptance, and how many answers parse and validate.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

from mirror_rt.runtime.grammar import Constraint

SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 160},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                      "facts": {"type": "array", "items": {"type": "string", "maxLength": 80},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["topic", "facts"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "category": {"enum": ["person", "place", "thing", "idea", "event"]},
                                      "related": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                  "maxItems": 3}},
     "required": ["name", "category", "related"], "additionalProperties": False},
]
QUESTIONS = [
    "What is the capital of France?",
    "Explain why the sky is blue.",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Name a famous scientist and what they discovered.",
    "What is the tallest mountain in the world?",
    "Describe the water cycle.",
    "What does a computer's CPU do?",
]


def messages(question: str, schema: dict) -> list[dict]:
    """The chat prompt of a schema question (the schema is named in the text for both runs)."""
    return [{"role": "user", "content": f"{question}\nAnswer in JSON matching this schema: {json.dumps(schema)}"}]


def valid(text: str, schema: dict) -> bool:
    """Whether `text` parses as JSON and validates against `schema` (jsonschema when installed)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict) and all(key in value for key in schema.get("required", ()))
    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


@dataclass
class Row:
    """One mode, constrained or not, summed over the prompts."""

    name: str
    tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0  # after the first token (the prompt's prefill excluded)
    committed: int = 0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    valid: int = 0
    runs: int = 0
    texts: list = field(default_factory=list)

    def add(self, generation, schema: dict) -> None:
        s = generation.stats
        self.tokens += s["new_tokens"]
        self.seconds += s["wall_time_s"]
        self.decode_seconds += s["wall_time_s"] - s["time_to_first_token_s"]
        self.committed += round(s["mean_accepted_length"] * s["steps"])
        self.steps += s["steps"]
        self.proposed += sum(s.get("proposed_per_position", []))
        self.accepted += sum(s.get("accepted_per_position", []))
        self.valid += valid(generation.text, schema)
        self.runs += 1
        self.texts.append(generation.text)

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        decode = (self.tokens - self.runs) / self.decode_seconds if self.decode_seconds else 0.0
        acceptance = f"{self.accepted / self.proposed:.3f}" if self.proposed else "-"
        mal = f"{self.committed / self.steps:.2f}" if self.steps else "-"
        return (f"{self.name:<22} {rate:6.1f} tok/s (decode {decode:6.1f})  mean accepted length {mal:>5}  "
                f"acceptance {acceptance:>5}  valid JSON {self.valid}/{self.runs}  "
                f"({self.tokens} tokens in {self.seconds:.1f} s)")


def run(engine, modes: list[str], limit: int = 8, max_new_tokens: int = 128) -> list[Row]:
    """Every (mode, constrained) row over the first `limit` questions, interleaved question by question."""
    rows = {(mode, c): Row(f"{mode} {'constrained' if c else 'unconstrained'}") for mode in modes for c in (1, 0)}
    for i, question in enumerate(QUESTIONS[:limit]):
        schema = SCHEMAS[i % len(SCHEMAS)]
        for (mode, constrained), row in rows.items():
            options = {"constraint": Constraint.json_schema(schema)} if constrained else {}
            row.add(engine.generate(messages(question, schema), mode=mode, max_new_tokens=max_new_tokens,
                                    temperature=0, **options), schema)
    return list(rows.values())


def report(rows: list[Row]) -> str:
    lines = [row.line() for row in rows]
    by_name = {row.name: row for row in rows}
    ar, mirror = by_name.get("ar constrained"), by_name.get("mirror constrained")
    if ar and mirror and ar.seconds and mirror.seconds:
        speedup = (mirror.tokens / mirror.seconds) / (ar.tokens / ar.seconds)
        decode = ((mirror.tokens - mirror.runs) / mirror.decode_seconds) / ((ar.tokens - ar.runs) / ar.decode_seconds)
        same = sum(a == m for a, m in zip(ar.texts, mirror.texts))
        lines.append(f"constrained mirror / constrained ar: {speedup:.2f}x tokens/s ({decode:.2f}x decode); "
                     f"same text {same}/{ar.runs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mirror_rt.evaluation.structured_bench", description=__doc__)
    parser.add_argument("--bundle", help="an exported bundle (default: the default model's bundle)")
    parser.add_argument("--modes", default="ar,mirror", help="comma-separated modes (default ar,mirror)")
    parser.add_argument("--limit", type=int, default=8, help="questions (1..8, default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cache-dir")
    args = parser.parse_args(argv)
    from mirror_rt.devices.engines import load_engine
    from mirror_rt.devices.options import EngineConfig

    engine = load_engine(EngineConfig.from_flags(bundle=args.bundle, cache_dir=args.cache_dir), mode="mirror")
    # warm-up: the first calls pay one-time costs (sessions, the grammar engine's view of the tokenizer)
    engine.generate("Hi", max_new_tokens=4, mode="mirror", constraint=Constraint.json_schema(SCHEMAS[0]))
    t0 = time.perf_counter()
    rows = run(engine, args.modes.split(","), args.limit, args.max_new_tokens)
    print(report(rows))
    elapsed = time.perf_counter() - t0
    print(f"{args.limit} questions, greedy, {args.max_new_tokens} new tokens at most, {elapsed:.0f} s; "
          f"engine: {engine.names.get('path')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
