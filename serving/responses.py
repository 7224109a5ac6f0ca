"""Completion bodies and SSE chunks, chat and text alike, from a job's events.

Non-streamed: one body with `choices`, `usage`, `timings` and `mirror_rt`. Streamed: a first
chunk (the assistant role, chat only), one chunk per batch of text (a decode step can commit
several tokens: they go out together; with `stream_options.include_origins`, each with its
tokens' origins, `serving.origins`), a last chunk with `finish_reason` and the figures, a usage
chunk with `choices: []` when `stream_options.include_usage`, then `data: [DONE]`. A failure
after the 200 header becomes a `data: {"error": ...}` event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from mirror_rt.serving.errors import APIError, envelope
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
    origins: bool = False  # stream_options.include_origins: content chunks carry `mirror_rt.tokens`

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def choice(self, text: str | None, finish_reason: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        key = "delta" if delta else "message"
        content = {"content": text} if delta and text is not None else {} if delta else {
            "role": "assistant", "content": text}
        return {"index": 0, key: content, "logprobs": None, "finish_reason": finish_reason}

    def body(self, choices: list, chunk: bool, **extra) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def usage(record: RequestRecord) -> dict:
    return {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
            "total_tokens": record.prompt_tokens + record.completion_tokens}


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
    return APIError(500, f"generation failed: {reason}")


async def collect(job, reply: Reply, timeout_s: float | None) -> dict:
    """Wait for the whole answer; the body, or an APIError."""
    pieces = []
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            pieces.append(value[0])
        elif kind == "end":
            break
    record = job.record
    if job.outcome != "done":
        raise failure(job, record, timeout_s)
    choice = reply.choice("".join(pieces), record.finish_reason, delta=False)
    return reply.body([choice], chunk=False, usage=usage(record), timings=record.timings(),
                      mirror_rt=record.speculation())


async def stream(job, reply: Reply, timeout_s: float | None):
    """SSE lines for a job, as bytes (the scheduler cancels the job if the client goes away)."""
    if reply.chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield sse(reply.body([first], chunk=True))
    while True:
        kind, value = await job.events.get()
        texts, made, entries = [], 0, []
        while kind == "text":  # a step's tokens go out as one chunk
            texts.append(value[0])
            made = value[1]
            entries += value[2] or ()
            if job.events.empty():
                break
            kind, value = job.events.get_nowait()
        if texts:
            extra = {"usage": partial_usage(reply.prompt_tokens, made)} if reply.continuous_usage else {}
            if reply.origins:
                extra["mirror_rt"] = {"tokens": entries}
            yield sse(reply.body([reply.choice("".join(texts), None, delta=True)], chunk=True, **extra))
        if kind == "end":
            break
    for event in final_events(job, reply, timeout_s):
        yield event


def final_events(job, reply: Reply, timeout_s: float | None) -> list[bytes]:
    record = job.record
    if job.outcome != "done":
        return [sse(failure(job, record, timeout_s).body()), b"data: [DONE]\n\n"]
    figures = {"timings": record.timings(), "mirror_rt": record.speculation()}
    last = reply.choice(None if reply.chat else "", record.finish_reason, delta=True)
    events = [sse(reply.body([last], chunk=True, **figures))]
    if reply.include_usage:
        events.append(sse(reply.body([], chunk=True, usage=usage(record), **figures)))
    return events + [b"data: [DONE]\n\n"]


def partial_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def error_event(status: int, message: str) -> bytes:
    return sse(envelope(status, message))


async def until_disconnected(receive) -> None:
    """Return when the client has gone (the ASGI `http.disconnect` event; never polling)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request, work, on_disconnect):
    """Await `work` unless the client disconnects first; then call `on_disconnect` and return None."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request.receive))
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
