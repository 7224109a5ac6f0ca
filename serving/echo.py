"""`echo` on text completions, as vLLM answers it: the prompt's text (with `logprobs`, the target's raw
log-probabilities of its tokens, the first one none) before the completion; with `max_tokens: 0` the prompt alone,
finish_reason `length`.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse, StreamingResponse

from mirror_rt.runtime.logprobs import TokenLogprob, prompt_logprobs
from mirror_rt.serving.protocol import context_error
from mirror_rt.serving.responses import Reply, echo_events, now, partial_usage, sse


async def echo_of(req, given: str | list[int], prompt: list[int], engine) -> tuple[str, tuple] | None:
    """(the prompt's text, its tokens' log-probabilities or ()) when the request echoes; None otherwise (`given`:
    the prompt as the request gave it, `prompt`: its token ids)."""
    if not req.echo:
        return None
    context = engine.target.max_seq_len
    if len(prompt) > context:
        raise context_error(context, len(prompt), 0)
    text = given if isinstance(given, str) else engine.tokenizer.decode(prompt)
    top = req.top_logprobs_asked()
    if top is None:
        return text, ()
    found = await asyncio.to_thread(prompt_logprobs, engine.target, prompt, top)
    return text, (TokenLogprob(prompt[0], None), *found[1:])


def echo_only(req, request_id: str, model_name: str, echoes: list[tuple[int, tuple[str, tuple]]], token_bytes):
    """The answer of `max_tokens: 0` with echo: each prompt alone (`echoes`: its token count and echo), streamed
    or not."""
    n = req.choices()
    replies = [Reply(request_id, model_name, False, req.include_usage(), now(), req.continuous_usage(),
                     prompt_tokens, n, token_bytes=token_bytes, echo=echo, first_index=p * n)
               for p, (prompt_tokens, echo) in enumerate(echoes)]
    usage = partial_usage(sum(prompt_tokens for prompt_tokens, _ in echoes), 0)
    if not req.stream:
        choices = [reply.final(i, "", "length", ()) for reply in replies for i in range(n)]
        return JSONResponse(replies[0].body(choices, chunk=False, usage=usage))

    def events():
        for reply in replies:
            yield from echo_events(reply)
            yield sse(reply.body([reply.delta(i, "", "length") for i in range(n)], chunk=True))
        if req.include_usage():
            yield sse(replies[0].body([], chunk=True, usage=usage))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
