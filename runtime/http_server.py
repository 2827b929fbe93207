"""`mg-serve`: an OpenAI-compatible HTTP server over one engine, with streaming and continuous batching.

    HTTP handlers (asyncio, FastAPI)  --submit / cancel-->  EngineWorker (one thread, one Engine)
                                      <--token deltas----   (step, hand out new tokens, repeat)

Every request becomes an engine `Request`; the worker thread owns the engine,
takes new requests and cancellations between steps (a request arriving
mid-generation joins the next step), and after each step hands every sequence's
new tokens to its handler through the handler's event loop. Handlers turn
tokens into text (held back while a UTF-8 character is incomplete), cut at stop
strings (then cancel the request so its slot / cells are freed at once), and
answer in the OpenAI format, as one JSON body or as server-sent events ending
with `data: [DONE]`. A client that disconnects cancels its request. Routes:
`POST /v1/completions`, `POST /v1/chat/completions` (needs a chat template:
`chat_template` of a `tokenizer_config.json` in the artifact directory),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Errors use
the OpenAI error body. Knows the engine, the tokenizer and the artifact; never
imports mg.export. See docs/ARCHITECTURE.md section 6.7.
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from starlette.requests import Request as HTTPRequest  # module level: FastAPI resolves annotations here

from .engine import Engine, Result
from .sampling import SamplingParams
from .scheduler import Request, RequestError
from .tokenizer import TextCodec

CHAT_TEMPLATE_FILE = "tokenizer_config.json"
MAX_STOP_STRINGS = 4


class HTTPError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- the engine thread ----------------------------------------------------------------------------------


@dataclass
class Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float = field(default_factory=time.perf_counter)
    sent: int = 0  # tokens handed out so far
    first_token: Optional[float] = None


class EngineWorker(threading.Thread):
    """Owns the engine: submits, cancels, steps, and hands out new tokens, all on this one thread."""

    def __init__(self, engine: Engine, metrics: "Metrics"):
        super().__init__(name="mg-engine", daemon=True)
        self.engine, self.metrics = engine, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted and not finished (read by handlers for the queue limit)
        self.failure: Optional[BaseException] = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, job: Job) -> None:
        with self._lock:
            self._in_flight += 1
        self._inbox.put(("submit", job))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stop(self) -> None:
        self._inbox.put(("stop", None))

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the engine failed: every waiting handler gets an error
            self.failure = e
            for job in list(self._jobs.values()):
                self._send(job, ("error", f"the engine failed: {type(e).__name__}: {e}"))
            raise

    def _loop(self) -> None:
        engine = self.engine
        while True:
            idle = engine.scheduler.idle
            try:
                item = self._inbox.get(block=idle)
            except queue.Empty:
                item = None
            while item is not None:
                what, value = item
                if what == "stop":
                    for job in list(self._jobs.values()):
                        self._finish(job, Result(job.request.id, (), "abort"))
                    return
                if what == "submit":
                    self._take(value)
                else:
                    self._drop(value)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if engine.scheduler.idle:
                continue
            t0 = time.perf_counter()
            spec = engine.spec_stats
            rounds, accepted = spec.rounds, spec.accepted_tokens
            engine.step()
            self.metrics.step(time.perf_counter() - t0, spec.rounds - rounds, spec.accepted_tokens - accepted)
            now = time.perf_counter()
            for seq in engine.scheduler.running:
                job = self._jobs.get(seq.request.id)
                if job is not None and len(seq.generated) > job.sent:
                    self._tokens(job, seq.generated[job.sent:], now)
            for result in engine.take_finished():
                job = self._jobs.get(result.id)
                if job is not None:
                    if len(result.tokens) > job.sent:
                        self._tokens(job, list(result.tokens[job.sent:]), now)
                    self._finish(job, result)
            self.metrics.load(len(engine.scheduler.waiting), len(engine.scheduler.running))

    def _take(self, job: Job) -> None:
        try:
            self.engine.submit(job.request)
        except RequestError as e:  # checked by the handler already; the engine has the last word
            self._finish(job, Result(job.request.id, (), None, str(e)))
            return
        self._jobs[job.request.id] = job

    def _drop(self, request_id: str) -> None:
        """Cancel: the request leaves the queue, or its sequence is freed (slot, cells, draft state) now."""
        job = self._jobs.get(request_id)
        if job is not None and self.engine.cancel(request_id):
            self._finish(job, Result(request_id, (), "cancelled"))

    def _tokens(self, job: Job, tokens: list[int], now: float) -> None:
        if job.first_token is None:
            job.first_token = now
            self.metrics.first_token(now - job.submitted)
        job.sent += len(tokens)
        self.metrics.generated(len(tokens))
        self._send(job, ("tokens", list(tokens)))

    def _finish(self, job: Job, result: Result) -> None:
        self._jobs.pop(job.request.id, None)
        with self._lock:
            self._in_flight -= 1
        self._send(job, ("error", result.error) if result.error else ("done", result.finish_reason))

    @staticmethod
    def _send(job: Job, event: tuple) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed (server shutting down)
            pass


# -- metrics --------------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics in a registry of their own (several servers may live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("mg_requests", "HTTP generation requests by outcome", ["status"], registry=r)
        self.prompt_tokens = Counter("mg_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("mg_generation_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("mg_queue_depth", "requests waiting for a sequence slot", registry=r)
        self.running = Gauge("mg_running_sequences", "sequences being generated", registry=r)
        self.step_seconds = Histogram("mg_step_seconds", "wall time of one engine step", registry=r,
                                      buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.ttft = Histogram("mg_time_to_first_token_seconds", "request arrival to its first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.acceptance = Histogram("mg_dflash_acceptance_length", "DFlash tokens per drafting round (accepted "
                                    "drafts + 1), per step", registry=r, buckets=tuple(range(1, 18)))

    def step(self, seconds: float, rounds: int, accepted: int) -> None:
        self.step_seconds.observe(seconds)
        if rounds:
            self.acceptance.observe((accepted + rounds) / rounds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def load(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# -- request parsing ------------------------------------------------------------------------------------


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise HTTPError(400, f"'{name}' is {value!r}; allowed: {kind} in [{lo}, {hi}]", name)
    return value


@dataclass
class Generation:
    """What a completion or chat request asks for, checked."""

    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_generation(body: Any, prompt: list[int], capacity: int, default_max: int) -> Generation:
    if body.get("n", 1) not in (1, None):
        raise HTTPError(400, f"'n' is {body.get('n')!r}; allowed: 1", "n")
    if body.get("best_of") not in (None, 1):
        raise HTTPError(400, f"'best_of' is {body.get('best_of')!r}; allowed: 1", "best_of")
    if body.get("echo") not in (None, False):
        raise HTTPError(400, "'echo' is true; allowed: false", "echo")
    if body.get("logprobs") not in (None, False):
        raise HTTPError(400, "'logprobs' is not supported; allowed: null", "logprobs")
    room = max(1, capacity - len(prompt))
    max_tokens = _number(body, "max_completion_tokens", None, 1, 1 << 31, True) or \
        _number(body, "max_tokens", min(default_max, room), 1, 1 << 31, True)
    temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _number(body, "top_k", 0, 0, 1 << 31, True)
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, True)
    if top_p == 0.0:
        raise HTTPError(400, "'top_p' is 0; allowed: a number in (0, 1]", "top_p")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        stops = tuple(stop)
    else:
        raise HTTPError(400, f"'stop' is {stop!r}; allowed: a string or a list of at most {MAX_STOP_STRINGS} "
                             f"strings", "stop")
    if any(s == "" for s in stops):
        raise HTTPError(400, "'stop' holds an empty string; allowed: non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, f"'stream' is {stream!r}; allowed: true | false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HTTPError(400, f"'stream_options' is {options!r}; allowed: an object", "stream_options")
    if temperature > 0 and seed is None:
        seed = secrets.randbits(63)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return Generation(max_tokens, params, stops, stream, bool(options.get("include_usage")))


class TextStream:
    """Tokens in, text out: complete characters only, cut before the first stop string."""

    def __init__(self, codec: TextCodec, stops: tuple[str, ...]):
        self.codec, self.stops = codec, stops
        self.tokens: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False
        self._hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be forming

    def add(self, tokens: list[int], final: bool = False) -> str:
        """The new text to emit after `tokens` (all that is left when `final`)."""
        self.tokens += tokens
        full = self.codec.decode(self.tokens)
        cut = min((full.find(s) for s in self.stops if s in full), default=-1)
        if cut >= 0:
            self.stopped, full, final = True, full[:cut], True
        if not final:
            full = full.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its other bytes
            if self.stops:
                full = full[:max(len(self.text), len(full) - self._hold)]
        if not full.startswith(self.text):  # decoding changed earlier text (rare): emit nothing more
            return ""
        delta, self.text = full[len(self.text):], full
        return delta


# -- the app --------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    worker: EngineWorker
    codec: Optional[TextCodec]
    model: str  # the name clients pass as `model`
    capacity: int
    check: Any  # the scheduler's admission check
    max_queue: int  # requests beyond the running ones that may wait
    n_slots: int
    api_key: Optional[str]
    metrics: Metrics
    chat_template: Optional[str] = None
    default_max_tokens: int = 16
    created: int = field(default_factory=lambda: int(time.time()))


def load_chat_template(directory: Path) -> Optional[str]:
    """`chat_template` of the artifact's tokenizer_config.json (Hugging Face convention), if any."""
    path = Path(directory) / CHAT_TEMPLATE_FILE
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template else None


def render_chat(template: str, messages: Any) -> str:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise HTTPError(400, "'messages' must be a non-empty list of {\"role\": str, \"content\": str}", "messages")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise HTTPError(400, f"the chat template failed on these messages: {e}", "messages") from None


def create_app(state: ServerState):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="mg-serve", docs_url=None, redoc_url=None)
    app.state.mg = state

    @app.exception_handler(HTTPError)
    async def _error(_, e: HTTPError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def _auth(request: HTTPRequest, call_next):
        if state.api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                e = HTTPError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key",
                              kind="authentication_error")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.worker.failure is not None or not state.worker.is_alive():
            return JSONResponse({"status": "error"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model, "object": "model", "created": state.created,
                                            "owned_by": "mg-toolchain"}]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = _encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise HTTPError(400, "'prompt' must be a non-empty string (or one list of token ids)", "prompt")
        return await _generate(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await _body(request)
        if state.chat_template is None:
            raise HTTPError(400, f"model {state.model!r} has no chat template (no chat_template in "
                                 f"{CHAT_TEMPLATE_FILE} of the artifact); use /v1/completions", "messages")
        text = render_chat(state.chat_template, body.get("messages"))
        return await _generate(request, body, _encode(text), chat=True)

    async def _body(request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise HTTPError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != state.model:
            raise HTTPError(404, f"model {model!r} is not served here; this server serves {state.model!r}", "model",
                            code="model_not_found")
        return body

    def _encode(text: str) -> list[int]:
        if state.codec is None:
            raise HTTPError(400, "this artifact has no tokenizer.json: send 'prompt' as a list of token ids", "prompt")
        if not text:
            raise HTTPError(400, "the prompt is empty", "prompt")
        return state.codec.encode(text)

    async def _generate(http: HTTPRequest, body: dict, ids: list[int], chat: bool):
        gen = parse_generation(body, ids, state.capacity, state.default_max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        request = Request(rid, tuple(ids), gen.max_tokens, gen.sampling)
        try:
            state.check(request)
        except RequestError as e:
            raise HTTPError(400, str(e).replace(f"request {rid!r}: ", "").replace("max_new_tokens", "max_tokens"),
                            "prompt" if "prompt" in str(e) else None,
                            code="context_length_exceeded" if "capacity" in str(e) else None) from None
        if state.worker.in_flight >= state.n_slots + state.max_queue:
            state.metrics.requests.labels("rejected").inc()
            raise HTTPError(429, f"the server is full ({state.worker.in_flight} requests in flight; --max-queue "
                                 f"{state.max_queue}); retry later", code="queue_full", kind="rate_limit_error")
        loop = asyncio.get_running_loop()
        job = Job(request, loop, asyncio.Queue())
        state.worker.submit(job)
        state.metrics.prompt_tokens.inc(len(ids))
        text = TextStream(state.codec, gen.stop) if state.codec is not None else None
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": state.model}
        if gen.stream:
            return StreamingResponse(_stream(job, gen, text, head, chat), media_type="text/event-stream")
        return await _whole(http, job, gen, text, head, chat)

    async def _events(job: Job, text: Optional[TextStream]):
        """(text delta, finish reason or None) as tokens arrive; cancels at a stop string."""
        while True:
            kind, value = await job.events.get()
            if kind == "error":
                state.metrics.requests.labels("error").inc()
                raise HTTPError(500, value, kind="server_error")
            if kind == "tokens":
                if text is None:
                    yield " ".join(map(str, value)) + " ", None
                    continue
                delta = text.add(value)
                if text.stopped:
                    state.worker.cancel(job.request.id)
                    yield delta, "stop"
                    await _drain(job)
                    return
                if delta:
                    yield delta, None
            else:  # done
                tail = text.add([], final=True) if text is not None else ""
                yield tail, "stop" if value == "eos" else "length"
                return

    async def _drain(job: Job) -> None:
        """Wait for the worker to confirm the cancel (so the slot is free before the response ends)."""
        while True:
            kind, _ = await job.events.get()
            if kind != "tokens":
                return

    async def _whole(http: HTTPRequest, job: Job, gen: Generation, text, head: dict, chat: bool):
        parts, reason = [], None
        events = _events(job, text)
        try:
            while True:
                waiter = asyncio.ensure_future(events.__anext__())
                while not waiter.done():
                    await asyncio.wait({waiter}, timeout=0.5)
                    if not waiter.done() and await http.is_disconnected():
                        waiter.cancel()
                        state.worker.cancel(job.request.id)
                        state.metrics.requests.labels("cancelled").inc()
                        return Response(status_code=499)
                try:
                    delta, reason = waiter.result()
                except StopAsyncIteration:
                    break
                parts.append(delta)
                if reason is not None:
                    break
        finally:
            await events.aclose()
        state.metrics.requests.labels("ok").inc()
        content = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason}
                  if chat else {"index": 0, "text": content, "finish_reason": reason, "logprobs": None})
        return {**head, "choices": [choice], "usage": _usage(job)}

    def _usage(job: Job) -> dict:
        n = len(job.request.prompt)
        return {"prompt_tokens": n, "completion_tokens": job.sent, "total_tokens": n + job.sent}

    async def _stream(job: Job, gen: Generation, text, head: dict, chat: bool):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(delta: Optional[str], reason: Optional[str], first: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, first=True)
            async for delta, reason in _events(job, text):
                if delta or reason is not None:
                    yield chunk(delta, reason)
                if reason is not None:
                    finished = True
            if gen.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(job)})}\n\n"
            yield "data: [DONE]\n\n"
            state.metrics.requests.labels("ok").inc()
        except HTTPError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            if not finished:  # the client went away (or the stream failed): free the slot now
                state.worker.cancel(job.request.id)
                state.metrics.requests.labels("cancelled").inc()

    return app
