"""Token rules (grammar, logit bias, penalties, logprobs) through every decoder: constrained sd and mirror
give constrained ar's text at temperature 0, sampling keeps the constrained target's distribution, every
answer matches its grammar, and the rules end every step at the committed text."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import MarkovModel, decode, random_transition
from test_acceptance import chi2_threshold

from mirror_rt.models.tokenizer import ByteTokenizer
from mirror_rt.runtime.acceptance import Verdict
from mirror_rt.runtime.grammar import Constraint, check, grammar_tokenizer
from mirror_rt.runtime.logprobs import token_logprobs
from mirror_rt.runtime.sampling import SamplingConfig
from mirror_rt.runtime.token_rules import RulesConfig, TokenRules, penalize, settle, verify_rows

jsonschema = pytest.importorskip("jsonschema")

# bounded schemas: a random tiny model must still finish its object within the token budget
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 999}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "name": {"type": "string", "maxLength": 6}},
     "required": ["color", "name"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 3},
                                      "score": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["tags", "score"], "additionalProperties": False},
]
PROMPTS = ["hello", "what is json?", "{", "name a color", "x", "give me a score", "tags please", "ok"]
OBJECT = Constraint.json_schema(SCHEMAS[0])


def byte_rules(constraint: Constraint | None = OBJECT, **config) -> TokenRules:
    return TokenRules.create(RulesConfig(constraint=constraint, **config), ByteTokenizer(), 258, [])


def text_of(rules: TokenRules) -> str:
    return ByteTokenizer().decode(rules.history)


def allowed(rules: TokenRules) -> list[int]:
    return torch.isfinite(rules.apply(np.zeros(258, dtype=np.float32))).nonzero().flatten().tolist()


# --- the rules object -------------------------------------------------------------------------

def test_apply_masks_accept_refuses_and_rollback_restores():
    """The mask allows what the grammar allows; a refused token changes nothing; rollback undoes accepts."""
    rules = byte_rules()
    assert allowed(rules) == [ord("{") + 2]
    start = allowed(rules)
    assert not rules.accept(ord("x") + 2) and rules.history == [] and allowed(rules) == start
    for ch in '{"ok": t':
        assert rules.accept(ord(ch) + 2)
    assert allowed(rules) == [ord("r") + 2] and rules.forced() == [ord(c) + 2 for c in 'rue, "n": ']
    rules.rollback(len(' t'))
    assert text_of(rules) == '{"ok":' and allowed(rules) == [ord(" ") + 2]
    rules.rollback(len(rules.history))
    assert allowed(rules) == start and not rules.finished()


def test_fork_is_independent_and_finished_allows_only_eos():
    rules = byte_rules(Constraint.choice(["yes", "no"]))
    copy = rules.fork()
    assert copy.accept(ord("y") + 2) and rules.history == [] and len(allowed(rules)) == 2
    for ch in "es":
        copy.accept(ord(ch) + 2)
    assert copy.finished() and allowed(copy) == [1] and copy.forced() == []


def test_refused_window_token_is_a_certain_rejection_and_settle_rolls_back():
    """verify_rows cuts the window at a refused token (p = 0 there); settle leaves the rules at the
    committed text plus the correction, however far the window went."""
    rules = byte_rules()
    window = [ord(c) + 2 for c in '{"ox']  # 'x' is refused after '{"o'
    logits = np.zeros((5, 258), dtype=np.float32)
    rows, tokens, advanced = verify_rows(rules, logits, window)
    assert tokens == window and advanced == 3 and rows.shape == (5, 258)
    assert rows[3, window[3]] == -np.inf  # the refused token cannot be accepted
    settle(rules, advanced, tokens, Verdict(0, 3, ord("k") + 2), logits)
    assert text_of(rules) == '{"ok'
    settle(rules, 0, [], Verdict(0, 0, ord('"') + 2), logits[:1])
    assert text_of(rules) == '{"ok"'


def test_min_tokens_masks_the_end_of_sequence_until_then():
    rules = byte_rules(None, min_tokens=2)
    eos = ByteTokenizer().eos_token_ids
    for step in range(4):
        assert (set(eos) <= set(allowed(rules))) == (step >= 2), step
        assert len(allowed(rules)) >= 258 - len(eos)
        if step == 1:
            assert not set(eos) & set(allowed(rules.fork()))  # a draft's copy masks it too
        rules.accept(ord("a") + 2)


def test_penalties_follow_the_docstring_example():
    x = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    out = penalize(x, {0: 2}, None, repetition=2.0, frequency=0.5, presence=1.0)
    assert out.tolist() == [-1.0, -1.0, 0.5] and x.tolist() == [2.0, -1.0, 0.5]
    seen = torch.tensor([1])
    assert penalize(x, {}, seen, 2.0, 0.0, 0.0).tolist() == [2.0, -2.0, 0.5]  # the prompt's ids


def test_logprobs_are_log_softmax_read_back_small():
    rows = torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = token_logprobs(rows, [4, 9, 0], top_n=5)
    reference = torch.log_softmax(rows, -1)
    for i, entry in enumerate(got):
        assert entry.logprob == pytest.approx(reference[i, entry.token].item(), abs=1e-12)
        ids = torch.topk(reference[i], 5).indices.tolist()
        assert [t for t, _ in entry.top] == ids
        assert [v for _, v in entry.top] == pytest.approx(reference[i, ids].tolist(), abs=1e-12)


def test_bad_grammars_are_one_line_reasons():
    tok = grammar_tokenizer(ByteTokenizer(), 258)
    assert "\n" not in check(Constraint("regex", "(["), tok) and check(Constraint("regex", "(["), tok)
    assert check(Constraint("choice", "[1]"), tok) == "a choice must be a non-empty list of strings"
    assert check(Constraint.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), tok)
    assert check(Constraint("grammar", 'root ::= "a" | "b"'), tok) == ""  # GBNF is converted to Lark
    with pytest.raises(ValueError):
        RulesConfig(presence_penalty=3.0)


# --- through the decoders ---------------------------------------------------------------------

def constrained(engine, prompt, mode, constraint, **options):
    return engine.generate(prompt, mode=mode, max_new_tokens=120, temperature=0, chat=False, constraint=constraint,
                           **options)


@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_greedy_constrained_sd_and_mirror_equal_ar(engine, schema):
    """8 prompts per schema; every answer parses and validates. The draft keeps up to the end: once the grammar is
    complete it drafts the end-of-sequence (it sent an empty window, a draft fault, and fell back to the target)."""
    constraint = Constraint.json_schema(SCHEMAS[schema])
    for prompt in PROMPTS:
        expected = constrained(engine, prompt, "ar", constraint)
        assert expected.stop_reason == "eos"
        jsonschema.validate(json.loads(expected.text), SCHEMAS[schema])
        for mode in ("sd", "mirror"):
            got = constrained(engine, prompt, mode, constraint)
            assert got.text == expected.text, (prompt, mode)
            assert not got.stats.get("events"), (prompt, mode, got.stats.get("events"))


@pytest.mark.parametrize("constraint, pattern", [
    (Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}"),
    (Constraint.choice(["alpha", "beta", "gamma"]), r"alpha|beta|gamma"),
    (Constraint("grammar", 'start: "(" xy xy xy ")"\nxy: "x" | "y"'), r"\((x|y){3}\)"),
    (Constraint("json_object"), r'\{.*'),  # a random model may write an endless key
])
def test_regex_choice_grammar_and_any_object(engine, constraint, pattern):
    for prompt in PROMPTS[:3]:
        expected = constrained(engine, prompt, "ar", constraint)
        assert re.fullmatch(pattern, expected.text, re.S), expected.text
        for mode in ("sd", "mirror"):
            assert constrained(engine, prompt, mode, constraint).text == expected.text


def test_penalties_and_bias_are_lossless(engine):
    options = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3,
                   logit_bias={ord("e") + 2: 4.0, ord("a") + 2: -100})
    for prompt in PROMPTS[:4]:
        expected = engine.generate(prompt, mode="ar", max_new_tokens=40, temperature=0, chat=False, **options)
        assert "a" not in expected.text
        assert expected.text != engine.generate(prompt, mode="ar", max_new_tokens=40, temperature=0, chat=False).text
        for mode in ("sd", "mirror"):
            got = engine.generate(prompt, mode=mode, max_new_tokens=40, temperature=0, chat=False, **options)
            assert got.text == expected.text


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_min_tokens_hold_the_end_and_the_stop_strings(engine, mode, temperature):
    """The end of sequence, biased to come first, comes right after min_tokens tokens, in every mode; a stop string
    within them is text."""
    eos = engine.tokenizer.eos_token_ids[0]
    options = dict(mode=mode, max_new_tokens=20, temperature=temperature, seed=5, chat=False, logit_bias={eos: 100})
    assert engine.generate("hello", **options).stats["new_tokens"] == 1
    held = engine.generate("hello", min_tokens=6, **options)
    assert held.stop_reason == "eos" and len(held.tokens) == 6 and held.stats["new_tokens"] == 7
    assert engine.generate("hello", min_tokens=6, stop_strings=[held.text[:1]], **options).text == held.text
    if not temperature:  # without min_tokens the same stop string cuts at once
        no_bias = {k: v for k, v in options.items() if k != "logit_bias"}
        assert engine.generate("hello", stop_strings=[held.text[:1]], **no_bias).text == ""


def test_logprobs_of_every_mode_equal_ar(engine):
    """The target's raw log-probabilities, one entry per generated token, with its top alternatives."""
    runs = {mode: engine.generate("hello", mode=mode, max_new_tokens=30, temperature=0, chat=False, logprobs=4,
                                  constraint=Constraint.json_schema(SCHEMAS[1]))
            for mode in ("ar", "sd", "mirror")}
    reference = runs["ar"].logprobs
    ended = [1] if runs["ar"].stop_reason == "eos" else []  # the end-of-sequence token has its entry too
    assert [e.token for e in reference] == runs["ar"].tokens + ended and all(len(e.top) == 4 for e in reference)
    assert all(e.logprob <= 0 and e.top[0][1] >= e.logprob for e in reference)
    for mode in ("sd", "mirror"):
        got = runs[mode].logprobs
        assert [e.token for e in got] == [e.token for e in reference]
        assert np.allclose([e.logprob for e in got], [e.logprob for e in reference], atol=1e-9)
        assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in reference]


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_seeded_sampled_constrained_repeats_and_validates(engine, mode):
    constraint = Constraint.json_schema(SCHEMAS[2])
    texts = [engine.generate(PROMPTS[i % 3], mode=mode, max_new_tokens=120, temperature=1.0, seed=i,
                             chat=False, constraint=constraint).text for i in (1, 1, 2, 3)]
    assert texts[0] == texts[1]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[2])


def markov_tokens(mode: str, p, q, n: int, rules: TokenRules) -> list[int]:
    return decode(MarkovModel(p), MarkovModel(q), [2], rules=rules, mode=mode, max_new_tokens=n, gamma=3,
                  sampling=SamplingConfig(temperature=1.0), seed=11).tokens


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_constrained_sampling_is_the_masked_target_chain(mode):
    """Sampled output under `[a-d]+` (end of sequence biased away) is a Markov chain with the target's
    transitions restricted to a..d and renormalised: a chi-square test per row at the 1 - 1e-6 quantile
    (3 degrees of freedom) over 3000 tokens; a correct implementation fails with probability < 4e-6, and
    the seed is fixed. The draft's chain (a different matrix) fails the same test."""
    letters = [ord(c) + 2 for c in "abcd"]
    p, q = random_transition(258, seed=3), random_transition(258, seed=4)
    rules = byte_rules(Constraint("regex", "[a-d]+"), logit_bias=((1, -100.0),))
    tokens = markov_tokens(mode, p, q, 3000, rules)
    assert set(tokens) <= set(letters) and rules.history == tokens
    counts = np.zeros((4, 4))
    for a, b in zip(tokens, tokens[1:]):
        counts[letters.index(a), letters.index(b)] += 1
    for matrix, fits in ((p, True), (q, False)):
        rows = matrix[np.ix_(letters, letters)]
        rows = rows / rows.sum(1, keepdims=True)
        expected = rows * counts.sum(1, keepdims=True)
        score = ((counts - expected) ** 2 / expected).sum(1)
        assert (score < chi2_threshold(3)).all() if fits else score.sum() > 10 * chi2_threshold(3)


def test_forced_tokens_are_drafted_without_a_forward(engine):
    """sd: the draft forwards fewer times than it proposes tokens when the grammar forces some."""
    generation = constrained(engine, "hello", "sd", Constraint.json_schema(SCHEMAS[0]))
    draft_forwards = len(generation.durations["draft_forward"])
    assert draft_forwards < generation.stats["new_tokens"] - 1
    # Mirror's draft thread drafts as far as it has time for before each verdict (timing: on this tiny model a
    # verdict can come before the draft reaches a forced position), so over three answers at least one has them
    forced = [constrained(engine, "hello", "mirror", Constraint.json_schema(SCHEMAS[0])).stats["forced_draft_tokens"]
              for _ in range(3)]
    assert sum(forced) > 0, forced


def test_mask_is_the_same_on_the_host_path_and_the_tensor_path():
    """Host float rows take numpy's path, other rows (bf16, device tensors) shift bits on the device."""
    from mirror_rt.runtime.grammar import mask_logits

    bits = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=9, dtype=np.int64).astype(np.int32)
    x = torch.randn(270, generator=torch.Generator().manual_seed(1))
    host, other = mask_logits(x, bits), mask_logits(x.to(torch.bfloat16), bits)
    expected = np.unpackbits(bits.view(np.uint8), bitorder="little")[:270].astype(bool)
    assert (torch.isfinite(host).numpy() == expected).all() and (torch.isfinite(other).numpy() == expected).all()
    assert torch.equal(host[torch.from_numpy(expected)], x[torch.from_numpy(expected)])
