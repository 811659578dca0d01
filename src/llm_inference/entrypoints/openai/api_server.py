"""The OpenAI-compatible HTTP server: `build_app(llm, ...)` and `run_server(...)`.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health,
/metrics. Every error is answered in OpenAI's format with its status: 400 bad parameters or a
prompt the engine refuses, 401 a missing or wrong API key (when one is set; /health and
/metrics stay open), 404 an unknown model, 413 a body over the size limit, 500 anything
unexpected (a bug: logged with its traceback), 503 from /health when the engine cannot serve
(`AsyncLLM.health`: stopped, or stuck with requests running).
"""

from __future__ import annotations

import asyncio
import hmac
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from llm_inference import pause_log
from llm_inference.engine.async_llm import AsyncLLM
from llm_inference.entrypoints.chat_template import load_chat_template
from llm_inference.entrypoints.openai import front_ends, metrics
from llm_inference.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llm_inference.entrypoints.openai.serving import OpenAIServing
from llm_inference.entrypoints.openai.streaming import ClientDisconnected
from llm_inference.entrypoints.openai.tool_parser import get_tool_parser
from llm_inference.gc_heap import freeze_startup_heap, thaw_heap
from llm_inference.models.default_model import DEFAULT_MODEL_NAME

MAX_BODY_BYTES = 8 * 1024 * 1024
JOIN_TIMEOUT_S = 15.0  # for another front end to stop (its graceful shutdown takes up to 10)
# With a pause log (pause_log.py), an event loop this much later than its tick is logged.
LOOP_LAG_S = 0.05
_OPEN_PATHS = ("/health", "/metrics")
JSON = b"application/json"


def _without(headers: list, name: bytes) -> list:
    return [(k, v) for k, v in headers if k.lower() != name]


async def _send_error(send, err: APIError, headers: list | None = None) -> None:
    await JSONResponse(err.body(), err.status, headers=dict(headers or []))(
        {"type": "http"}, None, send
    )


class GuardMiddleware:
    """API key check (Bearer token) and the request body size limit, before any routing.

    A body is read whole (up to `max_body_bytes`, else 413) and replayed to the app, so a
    chunked body without Content-Length is limited too. Every body is JSON, whatever its
    Content-Type says (curl's `-d` sends form-encoded), as vLLM reads it."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS:
            err = self._auth_error(headers.get(b"authorization", b"").decode("latin-1"))
            if err is not None:
                return await _send_error(send, err, [("WWW-Authenticate", "Bearer")])
        too_large = APIError(413, f"request body exceeds the limit of {self.max_body_bytes} "
                             "bytes", code="request_too_large")  # fmt: skip
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, too_large)
        body, more = b"", scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _send_error(send, too_large)
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        if body and headers.get(b"content-type", b"").split(b";")[0].strip() != JSON:
            scope = {**scope, "headers": [*_without(scope["headers"], b"content-type"),
                                          (b"content-type", JSON)]}  # fmt: skip

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _auth_error(self, authorization: str) -> APIError | None:
        scheme, _, token = authorization.partition(" ")
        if not authorization:
            message = "missing API key: send it as the header 'Authorization: Bearer <key>'"
        elif scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            message = "incorrect API key provided"
        else:
            return None
        return APIError(401, message, code="invalid_api_key")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The errors' message, and the first field they name as the param: a location's first
    string (an integer is a list index, or where the JSON that could not be parsed broke)."""
    parts, param = [], None
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            where = f" at character {loc[0]}" if loc else ""
            parts.append(f"body: not valid JSON{where}: {err.get('ctx', {}).get('error')}")
            continue
        param = param or next((x for x in loc if isinstance(x, str)), None)
        parts.append(f"{'.'.join(map(str, loc)) or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(APIError(400, message, param=param).body(), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException):
        err = APIError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        return JSONResponse(err.body(), exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def gone(_: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it: the client has gone

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        """Anything else is a bug, answered as a JSON 500 in the same format (not starlette's
        text/plain one). Starlette raises the exception again once this answer is sent, so
        the server (uvicorn) logs it with its traceback."""
        err = APIError(500, f"internal error: {exc!r}", type="server_error")
        return JSONResponse(err.body(), err.status)


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    shutdown_llm: bool = False,
    tool_call_parser: str = "llama3_json",
    chat_template: str | None = None,
    shared: front_ends.SharedMetrics | None = None,
) -> FastAPI:
    """The FastAPI app serving `llm` as `served_model_name` (shut down with the app if
    `shutdown_llm`); chat tool calls found by `tool_call_parser` (tool_parser.py); chats
    rendered by `chat_template` (a template's text), else the tokenizer's; `shared`: this
    front end's place among several (front_ends.py), whose /metrics add up."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        publisher = None if shared is None else asyncio.create_task(shared.run(llm.metrics))
        yield
        if publisher is not None:
            publisher.cancel()
        if shutdown_llm:
            llm.abort_all()
            llm.shutdown()

    app = FastAPI(title="llm_inference OpenAI-compatible server", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)
    serving = OpenAIServing(llm, served_model_name, tool_call_parser, chat_template)
    app.state.llm, app.state.serving = llm, serving
    created = int(time.time())

    @app.get("/health")
    async def health():
        reason = llm.health()  # stopped, its core gone, or stuck with requests running
        if reason is not None:
            raise APIError(503, reason, type="server_error")
        return {}

    @app.get("/metrics")
    async def get_metrics():
        counted = llm.metrics if shared is None else shared.gather(llm.metrics)
        body = metrics.render(counted, served_model_name)
        return PlainTextResponse(body, media_type=metrics.CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {"id": served_model_name, "object": "model", "created": created,
                "owned_by": "llm_inference", "root": llm.config.model_path,
                "max_model_len": llm.max_model_len}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt
            )
            tokens = (await asyncio.to_thread(serving.chat_prompt, chat))[1]
        else:
            tokens = await asyncio.to_thread(
                serving.tokenize, req.prompt, "prompt", add_special_tokens=req.add_special_tokens
            )
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        vocab = llm.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        return {"prompt": await asyncio.to_thread(serving.tokenizer.decode, req.tokens)}

    return app


def served_name(served_model_name: str | None, model: str | None) -> str:
    """The model's id in the API: the one asked for, else the model argument as given (as
    vLLM), else the default model's name (stable, unlike its cache folder's)."""
    return served_model_name or model or DEFAULT_MODEL_NAME


def startup_summary(llm: AsyncLLM, name: str, url: str, has_key: bool, front_ends: int = 1) -> str:
    """What the server serves, as vLLM logs it at start: the model and where it came from, the
    device and dtype, the context, the KV cache, the address and its front ends."""
    c, blocks = llm.config, llm.stats()["num_kv_blocks"]
    tp = c.parallel.tensor_parallel_size
    device = f"{c.device} x {tp} (tensor parallel)" if tp > 1 else c.device
    graphs = ", CUDA graphs" if c.kernel_backend == "triton" and not c.enforce_eager else ""
    key = " (API key required)" if has_key else ""
    key += f", {front_ends} front ends (--api-server-count)" if front_ends > 1 else ""
    return "\n".join([
        f"llm_inference: serving {name!r} from {c.model_path}",
        f"llm_inference: {device}, {c.dtype}, {c.kernel_backend} kernels{graphs}",
        f"llm_inference: max_model_len {c.scheduler.max_model_len}, KV cache {blocks} blocks of "
        f"{c.cache.block_size} tokens, max_num_seqs {c.scheduler.max_num_seqs}",
        f"llm_inference: OpenAI-compatible API at {url}/v1{key}",
    ])  # fmt: skip


def run_server(
    model: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    tool_call_parser: str = "llama3_json",
    chat_template: str | None = None,
    api_server_count: int | None = None,
    **engine_args,
) -> None:
    """Load the engine, then serve until SIGINT/SIGTERM, which aborts the running requests
    (their streams end with finish_reason "abort") and shuts down cleanly.
    `api_server_count`: HTTP front ends, each a process (front_ends.py); None: by the CPUs
    (`front_ends.default_count`)."""
    get_tool_parser(tool_call_parser)  # an unknown name fails before the model loads
    template = load_chat_template(chat_template)  # so does a missing template file
    if api_server_count is None:
        api_server_count = front_ends.default_count(engine_args)
    if api_server_count < 1:
        raise ValueError(f"api_server_count must be at least 1, got {api_server_count}")
    # the port, taken or not: now, before the model loads
    socks = front_ends.listen(host, port, api_server_count) if api_server_count > 1 else None
    llm = AsyncLLM(model, front_ends=api_server_count, **engine_args)
    name = served_name(served_model_name, model)
    url, has_key = f"http://{host}:{port}", api_key is not None
    print(startup_summary(llm, name, url, has_key, api_server_count), flush=True)
    serve_kwargs = dict(name=name, host=host, port=port, api_key=api_key, log_level=log_level,
                        tool_call_parser=tool_call_parser, chat_template=template)  # fmt: skip
    if api_server_count == 1:
        return serve(llm, **serve_kwargs)
    with tempfile.TemporaryDirectory(prefix="llm_inference_metrics_") as folder:
        pipes = llm.core_process.front_end_pipes
        others = front_ends.start_others(
            _serve_another, pipes, socks, folder, model, engine_args, serve_kwargs
        )
        shared = front_ends.SharedMetrics(folder, 0, api_server_count)
        serve(llm, sock=socks[0], shared=shared, others=others, **serve_kwargs)


def _serve_another(pipe, sock, shared, model, engine_args: dict, serve_kwargs: dict) -> None:
    """Another front end (in a process of its own): an AsyncLLM on `pipe` of the core."""
    serve(AsyncLLM(model, core_pipe=pipe, **engine_args), sock=sock, shared=shared, **serve_kwargs)


def serve(
    llm: AsyncLLM,
    *,
    name: str,
    host: str,
    port: int,
    api_key: str | None,
    log_level: str,
    tool_call_parser: str,
    chat_template: str | None,
    sock=None,
    shared: front_ends.SharedMetrics | None = None,
    others: list | None = None,
) -> None:
    """Serve `llm` (one front end) until a signal, or until its engine or one of `others`
    (the other front ends' processes, which it stops on its way out) stops; on `sock`
    (front_ends.listen's) if given, else on host:port."""
    import uvicorn

    app = build_app(llm, name, api_key=api_key, shutdown_llm=True, shared=shared,
                    tool_call_parser=tool_call_parser, chat_template=chat_template)  # fmt: skip
    freeze_startup_heap()
    log = pause_log.get()
    others = others or []

    def stop_others() -> None:
        """The other front ends stop (each aborts its requests) before this one's engine."""
        for p in others:
            if p.is_alive():
                p.terminate()

    class Server(uvicorn.Server):
        last_tick = time.monotonic()
        front_end_gone: list[str] | None = None  # the other front ends found exited

        def handle_exit(self, sig, frame) -> None:
            # Every request is aborted and the shutdown is bounded (timeout_graceful_shutdown,
            # AsyncLLM.shutdown's own timeout), so a second Ctrl-C only repeats the first: it
            # does not force uvicorn's exit, whose cancelled lifespan prints a traceback.
            stop_others()
            llm.abort_all()
            if not self.should_exit:
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            # uvicorn ticks every 0.1 s: a tick much later than that is an event loop held up.
            now = time.monotonic()
            if log is not None and now - self.last_tick >= LOOP_LAG_S + 0.1:
                log.write("loop_lag", (now - self.last_tick - 0.1) * 1e3)
            self.last_tick = now
            # A dead engine (its core process killed, a step failed) serves nothing: stop, so
            # that the exit status tells a supervisor to restart the server.
            if llm.error is not None and not self.should_exit:
                print(f"llm_inference: the engine stopped ({llm.error}); shutting down",
                      file=sys.stderr, flush=True)  # fmt: skip
                self.should_exit = True
            gone = [p.name for p in others if not p.is_alive()]
            if gone and not self.should_exit:  # (on a signal, they stop too)
                self.front_end_gone = gone
                print(f"llm_inference: front end {gone[0]} exited; shutting down",
                      file=sys.stderr, flush=True)  # fmt: skip
                self.should_exit = True
            if self.should_exit:
                stop_others()
            return await super().on_tick(counter)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=10)  # fmt: skip
    server = Server(config)
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        stop_others()
        for p in others:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
        error = llm.error
        llm.shutdown()
        thaw_heap()
    if error is not None:
        raise RuntimeError(f"the engine stopped: {error}")
    if server.front_end_gone is not None:
        raise RuntimeError(f"front end {server.front_end_gone[0]} exited")
