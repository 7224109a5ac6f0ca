"""What a request asks of the token rules: its grammar, logit bias, penalties and log-probabilities.

The grammar comes from `response_format`, vLLM's `structured_outputs`, or a forcing tool_choice; two at once is a
400. It is compiled before the request is queued: a grammar llguidance cannot run is a 400 naming the parameter.
"""

from __future__ import annotations

from mirror_rt.runtime.grammar import Constraint, check, grammar_tokenizer
from mirror_rt.serving import protocol
from mirror_rt.serving.errors import APIError
from mirror_rt.serving.tool_schema import closed, forced_schema, strict


def constraint_of(req: protocol.Sampling) -> tuple[Constraint | None, str | None, str | None]:
    """(constraint, its kind for the metrics, the parameter it came from) of a request."""
    found = []
    response_format = req.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append((Constraint("json_object"), "json_object", "response_format"))
        else:
            if response_format.json_schema is None:
                raise APIError(400, "response_format json_schema needs its 'json_schema'", "response_format")
            schema = response_format.json_schema.schema_
            if schema is not None and response_format.json_schema.strict:
                schema = closed(schema)
            found.append((Constraint("json_object") if schema is None else Constraint.json_schema(schema),
                          "json_schema", "response_format"))
    structured = req.structured()
    if structured is not None:
        found.append(_structured_outputs(structured))
    mode = req.tool_mode() if isinstance(req, protocol.ChatRequest) else None
    if mode not in (None, "auto"):  # required, or a named function
        schema = forced_schema(req.tools, mode, req.parallel_tool_calls is not False)
        found.append((Constraint.json_schema(schema), "tools", "tool_choice"))
    if len(found) > 1:
        raise APIError(400, f"{found[0][2]} and {found[1][2]} both constrain the output; send one", found[1][2])
    return found[0] if found else (None, None, None)


def _structured_outputs(spec: protocol.StructuredOutputs) -> tuple[Constraint, str, str]:
    given = {name: value for name, value in (("json", spec.json_), ("regex", spec.regex), ("choice", spec.choice),
                                            ("grammar", spec.grammar), ("json_object", spec.json_object))
             if value is not None and value is not False}
    if len(given) != 1:
        raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                       "structured_outputs")
    (name, value), = given.items()
    if name == "json":
        return Constraint.json_schema(value), "json_schema", "structured_outputs"
    if name == "choice":
        return Constraint.choice(value), "choice", "structured_outputs"
    if name == "json_object":
        return Constraint("json_object"), "json_object", "structured_outputs"
    return Constraint(name, value), name, "structured_outputs"


def checked(constraint: Constraint | None, param: str | None, engine, offered: list | None = None) -> None:
    """A 400 naming `param` when llguidance cannot run the grammar with the engine's tokenizer; first, one naming
    any `offered` tool whose parameters it cannot run (as OpenAI checks them)."""
    given = [(i, t) for i, t in enumerate(offered or ()) if t.function.parameters]
    if constraint is None and not given:
        return
    try:
        tokenizer = grammar_tokenizer(engine.tokenizer, engine.target.vocab_size)
    except ValueError as exc:
        raise APIError(400, f"structured output is not available for this model: {exc}", param) from None
    for i, tool in given:
        reason = check(Constraint.json_schema(strict(tool.function.parameters)), tokenizer)
        if reason:
            raise APIError(400, f"invalid parameters of tool '{tool.function.name}': {reason}",
                           f"tools.{i}.function.parameters")
    reason = check(constraint, tokenizer) if constraint is not None else None
    if reason:
        raise APIError(400, f"invalid {param}: {reason}", param)


def rules_options(req: protocol.Sampling, constraint: Constraint | None, vocab_size: int) -> dict:
    """The RulesConfig fields of a request (as `make_config` takes them)."""
    bias = []
    for key, value in (req.logit_bias or {}).items():
        if not (key.isdigit() and int(key) < vocab_size):
            raise APIError(400, f"logit_bias keys must be token ids in 0..{vocab_size - 1}, got '{key}'", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(400, f"logit_bias values must be in -100..100, got {value}", "logit_bias")
        bias.append((int(key), float(value)))
    return dict(constraint=constraint, logit_bias=tuple(bias), presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logprobs=req.top_logprobs_asked(), min_tokens=req.min_tokens or 0)
