"""The OpenAI-compatible app: routes, admission, streaming, and the engine it serves.

`create_app(settings, load)` loads the engine in the background (`/health` answers 503 until ready). Routes:
`POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`, `GET /v1/models[/ID]`, `GET /server` (behind the API
key when one is set), `GET /health`, `/metrics`, `/version`, `POST /tokenize`, `/detokenize`, and the page (`GET /`,
`/ui/*`).
Text too long by its characters alone is refused unread; a full queue answers 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mirror_rt.runtime.batch.decoder import WINDOW_ROOM
from mirror_rt.runtime.batch.kv_rows import BLOCK_SIZE
from mirror_rt.runtime.config import GenerationConfig, make_config
from mirror_rt.runtime.engine import GenerationError, PromptError
from mirror_rt.serving import openai_responses, protocol, structured, tools
from mirror_rt.serving.echo import echo_of, echo_only
from mirror_rt.serving.errors import APIError, install_handlers
from mirror_rt.serving.guard import Guard
from mirror_rt.serving.intake import check_key, read_json, refuse_unread
from mirror_rt.serving.logprobs import token_bytes_of
from mirror_rt.serving.metrics import ServerMetrics, Sink
from mirror_rt.serving.openai_responses import ResponseShape
from mirror_rt.serving.page import add_page_routes
from mirror_rt.serving.records import RequestRecord
from mirror_rt.serving.responses import Reply, collect_all, now, race_disconnect, stream_all
from mirror_rt.serving.scheduler import Draining, Job, Overloaded, Scheduler, TooManyChoices
from mirror_rt.serving.settings import ServerConfig
from mirror_rt.serving.tokenize import add_token_routes

log = logging.getLogger("mirror_rt.serve")
LOAD_THREAD = "mirror-load"  # the thread that loads the engine while the server already answers


class ServerState:
    """The engine, its scheduler and metrics, and where the server is in its life."""

    def __init__(self, settings: ServerConfig, metrics_sink: Sink | None = None):
        self.settings, self.metrics_sink = settings, metrics_sink
        self.status = "loading"  # loading | ready | draining | failed
        self.error: str | None = None
        self.engine = self.scheduler = None
        self.context = 0  # tokens a request may hold, prompt and answer (served_context), once the engine is ready
        self.metrics: ServerMetrics | None = None
        self.model_name = settings.served_model_name or "mirror-rt"
        self.early: collections.Counter = collections.Counter()  # responses answered before the metrics exist
        self.lock = threading.Lock()
        self.open_streams = 0  # streamed answers not yet ended (a stop waits for their last events)

    def attach(self, engine) -> None:
        """Serve `engine`: metrics, the engine thread, ready."""
        engine.decoder  # noqa: B018 -- built now: a KV budget that fits no request fails the load, not each request
        self.engine, self.context = engine, served_context(engine)
        self.model_name = self.settings.served_model_name or engine.names.get("model", "mirror-rt")
        metrics = ServerMetrics(self.model_name, sink=self.metrics_sink)
        with self.lock:
            for (handler, method, status), count in self.early.items():
                for _ in range(count):
                    metrics.responded(handler, method, status)
            self.metrics = metrics
        self.metrics.fallbacks(engine.placement)
        self.metrics.spec_enabled.labels(self.model_name).set(int(self.default_mode != "ar"))
        self.metrics.set_load(0, 0)
        self.metrics.step(0, engine.decoder)  # the KV budget and the caches' gauges from the first scrape
        self.scheduler = Scheduler(engine, self.settings.max_queued, self.settings.request_timeout,
                                   on_change=self.metrics.set_load, on_finish=self._finished,
                                   on_death=_exit_now if self.settings.exit_on_engine_death else None,
                                   on_step=self._stepped)
        self.status = "ready"

    @property
    def default_mode(self) -> str:
        """The mode of a request that names none: the server's `--mode`, else the engine's default."""
        return self.settings.defaults.mode or self.engine.default_mode

    def _stepped(self, batch: int) -> None:
        """After each step: the tokens each request committed, the batch it decoded, the cache figures."""
        for job in self.scheduler.live_jobs():
            self.metrics.progress(job)
        if self.engine.current_decoder is not None:
            self.metrics.step(batch, self.engine.current_decoder)

    def _finished(self, job: Job) -> None:
        self.metrics.progress(job)  # the tokens of its last step (it left the scheduler's live jobs within it)
        job.record = record = RequestRecord.from_job(job, self.engine.names)
        self.metrics.finished(record)
        log.info(record.log_line())

    def responded(self, handler: str, method: str, status: int) -> None:
        """Count one response (serving.guard); kept aside while the engine loads, then counted with the rest."""
        with self.lock:
            if self.metrics is None:
                self.early[(handler, method, status)] += 1
                return
        self.metrics.responded(handler, method, status)

    def record_echo_only(self, request_id: str, arrived: float, prompt_tokens: int) -> None:
        """A `max_tokens: 0` echo ran no generation, yet it is a request served: counted and logged as one."""
        record = RequestRecord(request_id, "done", "length", time.perf_counter() - arrived, None, True, prompt_tokens)
        self.metrics.prompt_tokens.labels(self.model_name).inc(prompt_tokens)  # read without a generation
        self.metrics.finished(record)
        log.info(record.log_line())

    def require_ready(self) -> None:
        if self.status == "ready" and not self.scheduler.alive():
            self.status, self.error = "failed", "the engine thread stopped"
        if self.status != "ready":
            what = {"loading": "the model is still loading", "draining": "the server is shutting down"}
            raise APIError(503, what.get(self.status, f"the engine failed to load: {self.error}"),
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    def require_model(self, name) -> None:
        """A 404 for a model name other than the served one (None: the request names none)."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")


def served_context(engine) -> int:
    """The context a request gets: the model's, or less where the KV budget cannot hold one request of the model's
    whole context (a prompt and its answer then stop at what the budget holds, and the start-up line says so)."""
    held = engine.decoder.budget.total * BLOCK_SIZE - WINDOW_ROOM
    return max(1, min(engine.target.max_seq_len, held))


def create_app(settings: ServerConfig, load: Callable[[], object], metrics_sink: Sink | None = None,
               log_failure: bool = True) -> FastAPI:
    """The app; `load()` builds the engine in a background thread; metric updates also reach `metrics_sink`.
    `log_failure` False: a failed load is not logged (the caller says it)."""
    state = ServerState(settings, metrics_sink)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=_load, args=(state, load, log_failure), name=LOAD_THREAD, daemon=True).start()
        yield
        if state.scheduler is not None:
            state.scheduler.close()

    app = FastAPI(title="mirror-rt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.mirror = state
    install_handlers(app)
    app.add_middleware(Guard, state=state)
    _add_status_routes(app, state)
    _add_completion_routes(app, state)
    add_token_routes(app, state)
    if settings.ui:
        add_page_routes(app)
    return app


def _exit_now(error: BaseException) -> None:
    log.error("the engine thread stopped (%s: %s): ending this replica", type(error).__name__, error)
    os._exit(1)


def _load(state: ServerState, load, log_failure: bool = True) -> None:
    try:
        state.attach(load())
        log.info("engine ready: %s", state.model_name)
    except BaseException as exc:  # noqa: BLE001 -- reported by /health and every request
        state.status, state.error = "failed", f"{type(exc).__name__}: {exc}"
        if log_failure:
            log.error("the engine failed to load: %s", state.error)


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        alive = state.scheduler is not None and state.scheduler.alive()
        if state.status == "ready" and alive:
            return {"status": "ok"}
        body = APIError(503, state.error or f"not ready: {state.status}").body()
        body["error"]["type"] = "unavailable_error"  # llama-server's type for a server not ready
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render() if state.metrics else b""
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("mirror-rt")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/server")
    async def server(request: Request):
        check_key(request, state)
        return _server_status(state)

    def card() -> dict:
        return {"id": state.model_name, "object": "model", "created": now(), "owned_by": "mirror-rt",
                "max_model_len": state.context}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request, state)
        state.require_ready()
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")  # the client's models.retrieve(); a path: served names may hold '/'
    async def model(request: Request, model: str):
        check_key(request, state)
        state.require_ready()
        state.require_model(model)
        return card()


def _server_status(state: ServerState) -> dict:
    """The server page's data: the engine's roles and defaults, then the metrics' load, totals and recent requests."""
    if state.metrics is None:
        return {"model": state.model_name, "status": state.status}
    names, defaults = state.engine.names, state.settings.defaults
    roles = {role: {"device": names.get(f"{role}_device"), "precision": names.get(f"{role}_precision")}
             for role in ("target", "draft")}
    return {"model": state.model_name, "status": state.status, "path": names.get("path"), "roles": roles,
            "max_queued": state.settings.max_queued, "mode": state.default_mode, "gamma": defaults.gamma,
            **state.metrics.status()}


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(request, state, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, state, chat=False)

    @app.post("/v1/responses")
    async def responses(request: Request):  # OpenAI's Responses API over the chat path (serving.openai_responses)
        arrived = time.perf_counter()
        check_key(request, state)
        req, chat = openai_responses.parse(await read_json(request))
        return await _serve(request, state, chat, True, arrived, ResponseShape(req, chat, state.model_name))


async def _complete(request: Request, state: ServerState, chat: bool):
    """A chat or text completion; a text completion's list of prompts is a batch: a job per prompt, one answer."""
    arrived = time.perf_counter()  # TTFT, queue time and latency count from here (as vLLM's): parsing, templating
    # and compiling a grammar are the request's wait too
    check_key(request, state)
    body = await read_json(request)
    req = protocol.parse(protocol.ChatRequest if chat else protocol.CompletionRequest, body)
    return await _serve(request, state, req, chat, arrived)


async def _serve(request: Request, state: ServerState, req: protocol.Sampling, chat: bool, arrived: float,
                 shape: ResponseShape | None = None):
    """Run a parsed request; `shape` reshapes a chat answer (the Responses API's), else it goes out as it is."""
    state.require_ready()
    state.require_model(req.model)
    engine = state.engine
    given = [None] if chat else req.prompts()
    for form in given:
        refuse_unread([m.text() for m in req.messages] if chat else [form], engine, state.context,
                      req.requested_tokens() or 0)
    prompts = [_prompt_ids(req, form, engine) for form in given]
    echoes = [None if chat else await echo_of(req, form, prompt, engine) for form, prompt in zip(given, prompts)]
    request_id = shape.id if shape else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{p}" for p in range(len(prompts))]
    if echoes[0] is not None and req.requested_tokens() == 0:
        for job_id, prompt in zip(ids, prompts):
            state.record_echo_only(job_id, arrived, len(prompt))
        return echo_only(req, request_id, state.model_name, [(len(p), e) for p, e in zip(prompts, echoes)],
                         _token_bytes(req, state))
    constraint, kind, param = structured.constraint_of(req)
    offered = req.tools if chat and req.tool_mode() else None
    await asyncio.to_thread(structured.checked, constraint, param, engine, offered)  # compiling may take a while
    rules = structured.rules_options(req, constraint, engine.target.vocab_size)
    loop, n = asyncio.get_running_loop(), req.choices()
    jobs = [Job(job_id, prompt, _config(req, len(prompt), state, rules), loop, choices=n, constraint=kind,
                origins=req.include_origins(), arrived=arrived) for job_id, prompt in zip(ids, prompts)]
    _admit(jobs, state)
    replies = [_reply(req, request_id, state, len(prompt), chat, echo, first_index=p * n)
               for p, (prompt, echo) in enumerate(zip(prompts, echoes))]
    if req.stream:
        chunks = _streamed(jobs, replies, state)
        return StreamingResponse(shape.events(chunks) if shape else chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def cancel():
        for job in jobs:
            state.scheduler.cancel(job)

    try:
        result = await race_disconnect(request, collect_all(jobs, replies, state.settings.request_timeout), cancel)
    except APIError:  # one prompt of a batch failed: the others stop too
        cancel()
        raise
    if result is None:
        return Response(status_code=499)
    return shape.body(result) if shape else result


def _prompt_ids(req: protocol.Sampling, given: str | list[int] | None, engine) -> list[int]:
    """A chat's templated messages, or one text completion prompt (`given`), as token ids; a 400 when empty."""
    try:
        prompt = tools.prompt_ids(req, engine.tokenizer) if given is None else engine.prompt_ids(given, chat=False)
    except PromptError as exc:  # an empty list of token ids
        raise APIError(400, str(exc), "prompt") from None
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt" if given is not None else "messages")
    return prompt


def _token_bytes(req: protocol.Sampling, state: ServerState):
    return token_bytes_of(state.engine) if req.top_logprobs_asked() is not None else None


def _reply(req: protocol.Sampling, request_id: str, state: ServerState, prompt_tokens: int, chat: bool,
           echo: tuple | None = None, first_index: int = 0) -> Reply:
    """How the request's answer is shaped (choices, tool calls, log-probabilities, an echoed prompt)."""
    tool_mode = req.tool_mode() if chat else None
    token_bytes = _token_bytes(req, state)
    return Reply(request_id, state.model_name, chat, req.include_usage(), now(), req.continuous_usage(),
                 prompt_tokens, req.choices(), tool_mode,
                 tuple(t.function.name for t in req.tools or ()) if tool_mode else (), token_bytes,
                 origins=req.include_origins(), parallel_tool_calls=not chat or req.parallel_tool_calls is not False,
                 echo=echo, first_index=first_index)


async def _streamed(jobs: list[Job], replies: list[Reply], state: ServerState):
    state.open_streams += 1
    try:
        async for chunk in stream_all(jobs, replies, state.settings.request_timeout):
            yield chunk
    finally:  # normal end, or the client went away (Starlette cancels this generator on disconnect)
        state.open_streams -= 1
        for job in jobs:
            if job.record is None:
                state.scheduler.cancel(job)


def _admit(jobs: list[Job], state: ServerState) -> None:
    """Admit a request's jobs, all of them or none."""
    retry = {"Retry-After": str(state.settings.retry_after_s)}
    try:
        state.scheduler.submit_all(jobs)
    except Overloaded as exc:
        state.metrics.rejected("queue_full")
        raise APIError(503, f"the server is busy: {exc}; retry later", headers=retry) from None
    except PromptError as exc:  # token ids given by the client, outside the vocabulary
        raise APIError(400, str(exc), "prompt") from None
    except TooManyChoices as exc:
        raise APIError(400, str(exc), "n" if len(jobs) == 1 else "prompt") from None
    except GenerationError as exc:  # one that can never fit the KV cache
        raise APIError(400, str(exc), "max_tokens") from None
    except Draining:
        state.metrics.rejected("draining")
        raise APIError(503, "the server is shutting down", headers=retry) from None


def _config(req: protocol.Sampling, prompt_tokens: int, state: ServerState, rules: dict) -> GenerationConfig:
    """The request's generation settings over the server's defaults (with its token `rules`); a 400 when it
    cannot fit."""
    context = state.context
    given = req.fields()
    requested = given.get("max_new_tokens")
    if prompt_tokens + (requested or 1) > context:
        raise protocol.context_error(context, prompt_tokens, requested or 0)
    # what a request that names none gets here: the rest of the context, OpenAI's temperature, a fresh seed
    unnamed = {"max_new_tokens": context - prompt_tokens, "temperature": state.settings.temperature,
               "seed": secrets.randbits(31)}
    return make_config(state.settings.defaults, **(unnamed | given | rules))
