"""The OpenAI request bodies mirror-rt honours, validated strictly, and what they ask of the engine.

Strict types and ranges ("5" is not a number, NaN is not a temperature); unknown fields are ignored (as vLLM and
OpenAI do); fields that would change the output but are not implemented are a 400 naming the parameter.
Extensions: `mode`, `num_assistant_tokens` (gamma, OVMS's name), `disable_spec_decode`, `sampling_verify`, vLLM's
`ignore_eos`, `top_k`, `min_p`, `min_tokens`,
`repetition_penalty`, `structured_outputs`, and `stream_options.include_origins`. `Sampling.fields` maps the
request names onto `GenerationConfig`'s; `serving.structured.rules_options` maps the token rules.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mirror_rt.runtime.config import MAX_GAMMA, MODES, SAMPLING_VERIFY
from mirror_rt.serving.errors import APIError

MAX_CHOICES = 16  # n: the choices decode together, one sequence each in the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's bound
COMPLETION_MAX_TOKENS = 16  # a text completion without max_tokens (OpenAI's and vLLM's default)


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far
    include_origins: bool | None = None  # mirror-rt's: every content chunk carries its tokens' origins


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object as text (OpenAI's shape)


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def text_parts_only(content, kinds: tuple):
    """`content` as sent, when each of its parts (if a list) is of one of the text `kinds`; else the error pydantic
    reports on the field."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise ValueError(f"content parts of type '{kind}' are not supported: this model reads text only")
    return content


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return text_parts_only(content, (None, "text"))

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's (vLLM's: required)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object (as json_object)
    strict: bool | None = None  # true: objects take no properties they do not declare (the schema is enforced)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's extension: exactly one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class Function(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class Sampling(Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension: -1 or 0 is off
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)  # vLLM's extension: 0 is off
    min_tokens: int | None = Field(None, ge=0)  # vLLM's extension: no end of sequence nor stop string before
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # an int64, as vLLM takes it
    stop: str | list[str] | None = None
    stream: bool | None = False  # null: false (OpenAI's and vLLM's)
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, allow_inf_nan=False)  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None  # on text completions too, as vLLM takes it
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names of structured_outputs' fields (clients still send them)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    mode: Literal[MODES] | None = None
    num_assistant_tokens: int | None = Field(None, ge=1, le=MAX_GAMMA)
    disable_spec_decode: bool | None = None
    sampling_verify: Literal[SAMPLING_VERIFY] | None = None  # rejection | exact-seed (runtime.acceptance)
    ignore_eos: bool | None = None  # vLLM's extension: keep generating past end-of-sequence (load tests)
    user: str | None = None  # OpenAI's end-user id: taken, unused
    # vLLM's extensions not implemented: their defaults are taken, any other value is a 400 (not ignored)
    include_stop_str_in_output: bool | None = None

    def refuse_unsupported(self) -> None:
        """A 400 naming the first parameter that asks for something not implemented."""
        checks = [("stop", isinstance(self.stop, list) and "" in self.stop, "stop strings must not be empty"),
                  ("stop", self.stop == "", "stop strings must not be empty"),
                  ("stream_options", self.stream_options is not None and not self.stream,
                   "stream_options can only be sent with stream true"),  # vLLM's 400
                  *[(name, getattr(self, name) not in (None, 0, False), f"{name} is not supported")
                    for name in ("include_stop_str_in_output",)]]
        for param, failed, message in checks:
            if failed:
                raise APIError(400, message, param)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def structured(self) -> StructuredOutputs | None:
        """structured_outputs, or the same from vLLM's older `guided_*` fields; a 400 when both are sent."""
        guided = {name: value for name in ("json", "regex", "choice", "grammar")
                  if (value := getattr(self, f"guided_{name}")) is not None}
        if guided and self.structured_outputs is not None:
            raise APIError(400, "send structured_outputs or the guided_* fields, not both", "structured_outputs")
        if guided:
            return StructuredOutputs.model_validate(guided)
        return self.structured_outputs

    def include_usage(self) -> bool:
        """vLLM's rule: once `stream_options` is sent, usage is included unless it says false."""
        return self.stream_options is not None and self.stream_options.include_usage is not False

    def continuous_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    def include_origins(self) -> bool:
        return bool(self.stream) and self.stream_options is not None and bool(self.stream_options.include_origins)

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def fields(self) -> dict:
        """The `GenerationConfig` fields this request sets, by their runtime names (the rest are the server's)."""
        top_k = None if self.top_k is None else max(self.top_k, 0)
        values = {"max_new_tokens": self.requested_tokens(), "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": top_k, "min_p": self.min_p, "seed": self.seed, "stop_strings": self.stop_strings() or None,
                  "ignore_eos": self.ignore_eos, "gamma": self.num_assistant_tokens,
                  "mode": "ar" if self.disable_spec_decode else self.mode, "sampling_verify": self.sampling_verify}
        return {name: value for name, value in values.items() if value is not None}

    def choices(self) -> int:
        return self.n or 1


def _refuse_unanswered_calls(messages: list[Message]) -> None:
    """As OpenAI: a tool message answers a call of the assistant message right before it (tool messages between),
    and every call with an id gets its answer before the next other message."""
    called: set[str] | None = None  # the ids of the calls just before; None: no assistant calls just before
    waiting: set[str] = set()
    for i, message in enumerate(messages):
        if message.role == "tool":
            if called is None:
                raise APIError(400, f"messages[{i}]: a message with role 'tool' must answer a preceding assistant "
                                    f"message with 'tool_calls'", f"messages.{i}.role")
            if called and message.tool_call_id not in called:
                raise APIError(400, f"messages[{i}] answers tool_call_id '{message.tool_call_id}', which the "
                                    f"assistant message before it did not call", f"messages.{i}.tool_call_id")
            waiting.discard(message.tool_call_id)
            continue
        if waiting:
            raise _unanswered(waiting, i)
        calls = message.tool_calls if message.role == "assistant" else None
        called = {call.id for call in calls if call.id} if calls else None
        waiting = set(called or ())
    if waiting:
        raise _unanswered(waiting, len(messages))


def _unanswered(ids: set[str], i: int) -> APIError:
    return APIError(400, f"an assistant message with 'tool_calls' must be followed by tool messages answering each "
                         f"tool_call_id; no answer for: {', '.join(sorted(ids))}", f"messages.{i}")


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    continue_final_message: bool | None = None  # vLLM's; not implemented (true is a 400)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.continue_final_message:
            raise APIError(400, "continue_final_message is not supported", "continue_final_message")
        if self.top_logprobs is not None and self.top_logprobs > MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be at most {MAX_TOP_LOGPROBS}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        self._refuse_tool_mistakes()
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                t.function.name for t in self.tools or ()}:
            raise APIError(400, f"tool_choice names '{self.tool_choice.function.name}', which is not in tools",
                           "tool_choice")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")

    def _refuse_tool_mistakes(self) -> None:
        """What OpenAI refuses too: a tool result that names no call, two tools under one name."""
        for i, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise APIError(400, f"messages[{i}] is a tool message without tool_call_id (the call it answers)",
                               f"messages.{i}.tool_call_id")
            if message.content is None and message.role != "assistant":  # only an assistant's calls stand alone
                raise APIError(400, f"messages[{i}] ({message.role}) needs its content", f"messages.{i}.content")
        _refuse_unanswered_calls(self.messages)
        names = [t.function.name for t in self.tools or ()]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise APIError(400, f"tools has more than one function named '{twice}'", "tools")

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def fields(self) -> dict:
        """A forced tool call (required, a named function) is not cut by stop strings: they would leave its
        arguments invalid JSON under finish_reason tool_calls."""
        forced = self.tool_mode() not in (None, "auto")
        return super().fields() | ({"stop_strings": ()} if forced else {})

    def tool_mode(self) -> str | None:
        """none | auto | required | the named function; None without tools (or with tool_choice none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # OpenAI's forms: a list of texts or of id lists is a batch
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt (and its log-probabilities) alone
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None  # the prompt's text (and its tokens' log-probabilities) before the completion
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def requested_tokens(self) -> int | None:
        """A text completion that names no limit gets 16 tokens (OpenAI's and vLLM's default)."""
        given = super().requested_tokens()
        return COMPLETION_MAX_TOKENS if given is None else given

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.prompt == []:
            raise APIError(400, "the prompt is empty", "prompt")
        prompts = self.prompts()
        for index, prompt in enumerate(prompts):
            if prompt in ("", []):
                raise APIError(400, "the prompt is empty" if len(prompts) == 1 else f"prompt {index} is empty",
                               "prompt")
        if self.requested_tokens() == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        for param, value in (("suffix", self.suffix), ("best_of", self.best_of not in (None, 1))):
            if value:
                raise APIError(400, f"{param} is not supported", param)
        if self.logprobs is not None and self.logprobs > MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be at most {MAX_TOP_LOGPROBS}", "logprobs")

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids: a batch (["text", ...] or [[ids], ...]) or one prompt."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


def parse(model: type[Sampling], body) -> Sampling:
    """Validate a decoded JSON body; a 400 naming the first bad field otherwise."""
    request = parse_as(model, body)
    request.refuse_unsupported()
    return request


def parse_as(model: type[BaseModel], body, at: str = ""):
    """`body` validated as `model`; a 400 naming the first bad field (under `at`, a path such as `input.2`)."""
    if not isinstance(body, dict):
        raise APIError(400, f"'{at}' must be a JSON object" if at else "the request body must be a JSON object",
                       at or None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        paths = [[at] * bool(at) + [str(p) for p in error["loc"] if not _union_tag(p)] for error in exc.errors()]
        deepest = max(range(len(paths)), key=lambda i: len(paths[i]))  # the union member that got furthest
        param = ".".join(paths[deepest]) or None
        raise APIError(400, f"invalid value for '{param}': {exc.errors()[deepest]['msg']}", param) from None


def _union_tag(part) -> bool:
    """Whether a pydantic error location part names a union member, not a field (`prompt`, not `prompt.str`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or not part.islower()
                                      or not part.replace("_", "").isalnum())


def context_error(context: int, prompt_tokens: int, requested: int) -> APIError:
    """vLLM's sentence for a prompt and output that do not fit (clients parse its first clause)."""
    total = prompt_tokens + requested
    return APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                         f"{requested} output tokens and your prompt contains at least {prompt_tokens} input tokens, "
                         f"for a total of at least {total} tokens. Please reduce the length of the input prompt or "
                         f"the number of requested output tokens. (parameter=input_tokens, value={prompt_tokens})",
                    "input_tokens")
