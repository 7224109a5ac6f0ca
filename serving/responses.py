"""Completion bodies and SSE chunks, chat and text alike, from a job's events.

Non-streamed: one body with `choices`, `usage`, `timings` and `mirror_rt`. Streamed: the role chunk (chat), one
chunk per step's text of a choice (with log-probabilities and origins when asked), each choice's `finish_reason`
(the last with the figures), a usage chunk when asked, then `[DONE]`. With tools, a choice's text is held until it
ends, then sent as tool calls or text. A failure after the 200 is a `data: {"error": ...}` event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from mirror_rt.runtime.engine import GenerationError
from mirror_rt.runtime.grammar import GrammarError
from mirror_rt.serving import tools
from mirror_rt.serving.errors import APIError
from mirror_rt.serving.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from mirror_rt.serving.records import RequestRecord


@dataclass(frozen=True)
class Reply:
    """How to shape one request's answer."""

    id: str
    model: str
    chat: bool  # chat.completion(s) or text_completion
    include_usage: bool = False
    created: int = 0
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage so far on every chunk
    prompt_tokens: int = 0
    choices: int = 1  # n
    tool_mode: str | None = None  # auto | required | a function's name; None: no tools (serving.tools)
    tool_names: tuple[str, ...] = ()
    token_bytes: Callable[[int], bytes] | None = None  # set when log-probabilities are asked for
    origins: bool = False  # stream_options.include_origins: content chunks carry `mirror_rt.tokens`
    parallel_tool_calls: bool = True  # false: at most one call per answer
    echo: tuple[str, tuple] | None = None  # text completions' echo: the prompt's text and log-probabilities
    first_index: int = 0  # the index of choice 0: a text completion's prompt p of a batch has p x n (OpenAI's)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def body(self, choices: list, chunk: bool, **extra) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def logprobs(self, entries, at: TextOffsets | None = None) -> dict | None:
        if self.token_bytes is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_bytes)
        return completion_logprobs(entries, self.token_bytes, at)

    def final(self, index: int, text: str, finish_reason: str, entries) -> dict:
        """A whole choice (non-streamed): the message with any tool calls, or the text."""
        index += self.first_index
        if not self.chat:
            if self.echo is not None:
                text, entries = self.echo[0] + text, [*self.echo[1], *entries]
            return {"index": index, "text": text, "logprobs": self.logprobs(entries), "finish_reason": finish_reason}
        content, calls = tools.parse_calls(text, self.tool_names, self.tool_mode, self.parallel_tool_calls)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": self.logprobs(entries),
                "finish_reason": _with_calls(finish_reason, bool(calls))}

    def delta(self, index: int, text: str | None, finish_reason: str | None = None, entries=(),
              at: TextOffsets | None = None) -> dict:
        """One streamed choice: new text (and its tokens' log-probabilities, `at`: the choice's text offsets so
        far) or the finish."""
        logprobs = self.logprobs(entries, at) if entries else None
        index += self.first_index
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        delta = {"content": text} if text is not None else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def buffered(self, index: int, text: str, entries) -> tuple[list[dict], bool]:
        """The deltas of a choice held until its end (each call's id and name, then its arguments); whether it
        made calls."""
        content, calls = tools.parse_calls(text, self.tool_names, self.tool_mode, self.parallel_tool_calls)
        deltas = [self.delta(index, content, entries=entries)] if content or entries else []
        index += self.first_index
        for i, call in enumerate(calls):
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            deltas.append({"index": index, "delta": {"tool_calls": [head]}, "logprobs": None, "finish_reason": None})
            arguments = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
            deltas.append({"index": index, "delta": {"tool_calls": [arguments]}, "logprobs": None,
                           "finish_reason": None})
        return deltas, bool(calls)


def _with_calls(finish_reason: str, called: bool) -> str:
    """OpenAI's finish reason of an answer that calls tools (a cut one stays `length`)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def usage(record: RequestRecord) -> dict:
    return partial_usage(record.prompt_tokens, record.completion_tokens)


def failure(job, record: RequestRecord, timeout_s: float | None) -> APIError:
    """The error a job that did not finish normally ends with."""
    if job.outcome == "timeout":
        return APIError(504, f"generation stopped at the request timeout of {timeout_s:g} s "
                             f"({record.completion_tokens} tokens generated)")
    if job.outcome == "cancelled":
        return APIError(503, "the request was cancelled: the server is shutting down", headers={"Retry-After": "1"})
    reason = f"{type(job.error).__name__}: {job.error}" if job.error else "unknown error"
    if job.error is not None and not isinstance(job.error, Exception):  # SystemExit and the like: the engine stopped
        return APIError(503, f"the engine stopped before answering ({reason}); retry on another server",
                        headers={"Retry-After": "1", "x-mirror-rt-retry": "engine-stopped"})
    if isinstance(job.error, (GenerationError, GrammarError)):  # a request the engine cannot serve (its grammar)
        return APIError(400, str(job.error))
    return APIError(500, f"generation failed: {reason}")


async def collect(job, reply: Reply, timeout_s: float | None) -> dict:
    """Wait for the whole answer; the body, or an APIError."""
    texts, entries = defaultdict(list), defaultdict(list)
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            index, piece, _, logprobs, _ = value
            texts[index].append(piece)
            entries[index] += logprobs
        elif kind == "end":
            break
    record = job.record
    if job.outcome != "done":
        raise failure(job, record, timeout_s)
    choices = [reply.final(i, "".join(texts[i]), reason, entries[i]) for i, reason in enumerate(record.finish_reasons)]
    return reply.body(choices, chunk=False, usage=usage(record), timings=record.timings(),
                      mirror_rt=record.speculation())


async def collect_all(jobs: list, replies: list[Reply], timeout_s: float | None) -> dict:
    """`collect` for the prompts of one text completion: one body, every prompt's choices in order, usage summed,
    each prompt's figures under `mirror_rt.prompts`; the first failure's APIError (the caller cancels the rest)."""
    if len(jobs) == 1:
        return await collect(jobs[0], replies[0], timeout_s)
    tasks = [asyncio.ensure_future(collect(job, reply, timeout_s)) for job, reply in zip(jobs, replies)]
    try:
        bodies = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    records = [job.record for job in jobs]
    figures = [{"timings": body["timings"], **body["mirror_rt"]} for body in bodies]
    return replies[0].body([choice for body in bodies for choice in body["choices"]], chunk=False,
                           usage=summed_usage(records), mirror_rt={"prompts": figures})


async def stream_all(jobs: list, replies: list[Reply], timeout_s: float | None):
    """`stream` for the prompts of one text completion: their chunks as they come (each choice's index its
    prompt's p x n + i), then one usage chunk summed over them when asked, and `[DONE]`; a prompt's failure ends
    the stream after its error event (the caller cancels the rest)."""
    if len(jobs) == 1:
        async for chunk in stream(jobs[0], replies[0], timeout_s):
            yield chunk
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(job, reply):
        try:
            async for chunk in stream(job, reply, timeout_s, tail=False):
                await merged.put(chunk)
        finally:
            await merged.put(job)

    tasks = [asyncio.ensure_future(pump(job, reply)) for job, reply in zip(jobs, replies)]
    try:
        for _ in jobs:
            while isinstance(item := await merged.get(), bytes):
                yield item
            if item.outcome != "done":
                break
        else:
            if replies[0].include_usage:
                yield sse(replies[0].body([], chunk=True, usage=summed_usage([job.record for job in jobs])))
    finally:
        for task in tasks:
            task.cancel()
    yield b"data: [DONE]\n\n"


async def stream(job, reply: Reply, timeout_s: float | None, tail: bool = True):
    """SSE lines for a job, as bytes (the scheduler cancels the job if the client goes away); without `tail`, no
    usage chunk and no `[DONE]` (one prompt of a batch: `stream_all`)."""
    if reply.chat:
        yield sse(reply.body([{"index": reply.first_index + i, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None} for i in range(reply.choices)], chunk=True))
    held, offsets, calls = defaultdict(list), defaultdict(TextOffsets), {}  # tool requests hold each choice's text
    if reply.echo is not None:  # the prompt first (serving.echo)
        for index, event in enumerate(echo_events(reply)):
            yield event
            offsets[index] = TextOffsets(reply.echo[1] if reply.token_bytes else (), reply.token_bytes)
    while True:
        kind, value = await job.events.get()
        batch = [value] if kind == "text" else []
        while kind == "text" and not job.events.empty():  # a step's tokens go out as one chunk
            kind, value = job.events.get_nowait()
            if kind == "text":
                batch.append(value)
        for index, text, made, entries, origins in _grouped(batch):
            if reply.tool_mode:
                held[index].append((text, entries))
                continue
            extra = {"usage": partial_usage(reply.prompt_tokens, made)} if reply.continuous_usage else {}
            if reply.origins and origins:
                extra["mirror_rt"] = {"tokens": origins}
            yield sse(reply.body([reply.delta(index, text, entries=entries, at=offsets[index])], chunk=True,
                                 **extra))
        if kind == "choice_end" and reply.tool_mode:
            text = "".join(t for t, _ in held[value])
            deltas, calls[value] = reply.buffered(value, text, [e for _, es in held[value] for e in es])
            for delta in deltas:
                yield sse(reply.body([delta], chunk=True))
        if kind == "end":
            break
    for event in final_events(job, reply, timeout_s, calls, tail):
        yield event


def echo_events(reply: Reply) -> list[bytes]:
    """The echoed prompt as each choice's first chunk (text completions' `echo`: serving.echo)."""
    text, entries = reply.echo
    return [sse(reply.body([reply.delta(index, text, entries=entries)], chunk=True)) for index in range(reply.choices)]


def _grouped(batch: list) -> list:
    """Consecutive text events of one choice joined: (index, text, tokens made, log-probabilities, origins)."""
    out = []
    for index, piece, made, entries, origins in batch:
        if out and out[-1][0] == index:
            _, text, _, joined, trail = out[-1]
            out[-1] = (index, text + piece, made, joined + list(entries), trail + list(origins or ()))
        else:
            out.append((index, piece, made, list(entries), list(origins or ())))
    return [item for item in out if item[1] or item[3] or item[4]]  # text, log-probabilities or token origins


def final_events(job, reply: Reply, timeout_s: float | None, calls: dict | None = None,
                 tail: bool = True) -> list[bytes]:
    record = job.record
    done = [b"data: [DONE]\n\n"] if tail else []
    if job.outcome != "done":
        return [sse(failure(job, record, timeout_s).body()), *done]
    figures = {"timings": record.timings(), "mirror_rt": record.speculation()}
    called = calls or {}
    lasts = [reply.delta(i, None if reply.chat else "", _with_calls(reason, called.get(i, False)))
             for i, reason in enumerate(record.finish_reasons)]
    so_far = {"usage": usage(record)} if reply.continuous_usage else {}  # vLLM's: on the finishing chunks too
    events = [sse(reply.body([last], chunk=True, **so_far, **(figures if i == len(lasts) - 1 else {})))
              for i, last in enumerate(lasts)]
    if reply.include_usage and tail:
        events.append(sse(reply.body([], chunk=True, usage=usage(record), **figures)))
    return events + done


def summed_usage(records: list[RequestRecord]) -> dict:
    return partial_usage(sum(r.prompt_tokens for r in records), sum(r.completion_tokens for r in records))


def partial_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def race_disconnect(request, work, on_disconnect):
    """Await `work` unless the client disconnects first (the ASGI `http.disconnect` event; never polling); then call
    `on_disconnect` and return None."""
    async def until_disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected())
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        on_disconnect()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    on_disconnect()
    return None


def now() -> int:
    return int(time.time())
