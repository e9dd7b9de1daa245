"""The HTTP front: the OpenAI-compatible API (/v1), the admin API (/admin), health, readiness and
metrics. Stateless: tenant toggles live in the controller, engines in the replicas."""

import asyncio
import json
import logging
import math
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, field_validator
from pydantic.json_schema import models_json_schema
from pydantic_core import from_json
from ray import serve
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from app import auth
from app.config import AppConfig, admin_tokens_from_env, api_keys_from_env, check_adapter_name
from app.controller import AUDIT_KEEP, ControllerClient, ControllerUnavailable, GraphController
from app.failover import FAILOVER_TIMEOUT_S, Progress, merged, one_choice, with_request_seed
from app.logs import send_app_logs_to_stderr
from app.metrics import render
from app.openai_protocol import (
    ChatRequest,
    Choice,
    CompletionRequest,
    ResponseShape,
    error_body,
    error_response,
    out_of_range,
)
from app.readiness import ReadinessView
from policies.admission import admits
from policies.graph_policy import GraphPolicy
from policies.model_swap import MAX_PATH_CHARS
from workers.modeling.default_model import model_name
from workers.protocol import ChoiceChunk, Failure, GenerateRequest, Item, decode_item, encode
from workers.serving.sampling import InvalidRequest

log = logging.getLogger(__name__)
api = FastAPI(title="graphserve", docs_url=None, redoc_url=None, redirect_slashes=False)  # a 404, not a 307
RETRY_AFTER = {"Retry-After": "5"}
# An event stream is neither cached nor held by a buffering proxy in front (nginx buffers by default)
UNBUFFERED = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A request crosses to its replica in one message; under throughput-optimized mode that is a gRPC
# message, which Serve bounds (4 MiB unless RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH raises it).
try:
    from ray.serve._private.constants import RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH as _MESSAGE_LIMIT
except ImportError:  # a Ray that names it otherwise: its default
    _MESSAGE_LIMIT = 4 * 2**20
MAX_BODY_BYTES = _MESSAGE_LIMIT - 2**16  # room for what the request adds
BODY_TIMEOUT_S = 30.0
SEED_HEADER = "x-graphserve-seed"  # the seed a completion was sampled with: sent back as `seed`, it samples it again
SWAP_RETRY_S = 0.05
MAX_RECOMMENDED_BUCKETS = 64
DEFAULT_AUDIT_ENTRIES = 100  # what GET /admin/audit answers without ?limit
SCHEMA_REF = "#/components/schemas/{model}"


def _openapi() -> dict:
    """FastAPI's schema plus the OpenAI request bodies: their handlers parse the body themselves
    (strict JSON, OpenAI's 400s), so FastAPI does not see the models on its own."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
        _, defs = models_json_schema(
            [(m, "validation") for m in (CompletionRequest, ChatRequest)], ref_template=SCHEMA_REF
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        api.openapi_schema = schema
    return api.openapi_schema


def _body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra` declaring its JSON body as `model`."""
    ref = {"$ref": SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


api.openapi = _openapi


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's errors (404, 405 with its Allow header) in the API's own format."""
    if _is_api(request.url.path):
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def _is_api(path: str) -> bool:
    """An OpenAI route's path (`//v1/...` too, as clients that join a base URL ending in / send)."""
    return path.lstrip("/").split("/", 1)[0] == "v1"


@api.exception_handler(ControllerUnavailable)
async def _controller_unavailable(request: Request, exc: ControllerUnavailable) -> JSONResponse:
    """The controller is restarting or unreachable: a 503 to retry, in the API's own format."""
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    if _is_api(request.url.path):
        return error_response(503, "the graph controller is unavailable; retry shortly", headers=RETRY_AFTER)
    return JSONResponse(
        {"detail": "the graph controller is unavailable; retry shortly"}, status_code=503, headers=RETRY_AFTER
    )


class ToggleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cuda_graph: StrictBool


def _validation_message(e: ValidationError, body: object) -> tuple[str, str | None]:
    """The first error's message and the field it names, as a path into the client's `body`."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in body_path(err["loc"], body, err["type"] == "missing")) or None
    message = err["msg"].removeprefix("Value error, ")  # pydantic's wording around a validator's own message
    return f"{param}: {message}" if param else message, param


def body_path(loc: tuple, body: object, missing: bool) -> list:
    """The part of a validation error's location that is a path in the body, the keys and indexes
    found there, and the field it lacks (`missing`). The validator's own steps (the member of a
    union it tried, `str` or `list[int]`, a tagged union's tag) are left out: no client wrote them."""
    path, node = [], body
    for step in loc:
        if (isinstance(node, dict) and step in node) or (
            isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node)
        ):
            path.append(step)
            node = node[step]
    if missing and isinstance(node, dict) and loc and isinstance(loc[-1], str):
        path.append(loc[-1])
    return path


ROLLOUT_ACTIONS = ("pause", "resume", "promote", "abort")


def _rollout_response(result: dict, ok_status: int) -> JSONResponse:
    """The controller's answer to a rollout call: the rollout, or its refusal with the status it chose."""
    return _refusal(result) or JSONResponse(finite(result["rollout"]), status_code=ok_status)


def _swap_response(result: dict) -> JSONResponse:
    return _refusal(result) or JSONResponse(finite(result["swap"]), status_code=202)


def _refusal(result: dict) -> JSONResponse | None:
    """The controller's refusal as the admin API's 4xx (with the invalid field, when it names one)."""
    if "error" not in result:
        return None
    field = {"field": result["field"]} if result.get("field") else {}
    return JSONResponse({"detail": result["error"], **field}, status_code=result["status"])


async def validated(schema: type[CompletionRequest] | type[ChatRequest], body: dict) -> CompletionRequest | ChatRequest:
    """The request, validated. A body with a JSON schema is validated in a thread: checking that its
    grammar compiles (once per schema) can take seconds for a large one, which on the event loop
    held every stream of this ingress (13.9 s at 15,000 properties)."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        return await asyncio.to_thread(schema.model_validate, body)
    return schema.model_validate(body)


class BodyError(Exception):
    """A body that could not be read or is not a JSON object: the status and why, for each API to
    answer in its own error format."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _json_body(request: Request) -> dict:
    """The body as a JSON object, parsed strictly (unlike json.loads): a lone UTF-16 surrogate escape,
    NaN, Infinity, a number out of range and nesting past the parser's limit are all invalid JSON.
    Raises BodyError."""
    raw = await _read_body(request)
    try:
        body = from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        reason = str(e)
        if "surrogate" in reason or "hex escape" in reason:
            reason = f"a lone UTF-16 surrogate escape (\\ud800-\\udfff outside a pair), {reason}"
        elif re.search(rb"NaN|Infinity", raw):
            reason += " (NaN and Infinity are not JSON numbers)"
        elif "recursion limit" in reason:
            raise BodyError(
                400, "request body JSON is nested too deeply: arrays and objects more than 201 levels deep"
            ) from None
        raise BodyError(400, f"request body is not valid JSON: {reason}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object")
    return body


async def _read_body(request: Request) -> bytes:
    """The body's bytes, or BodyError saying why not: more than MAX_BODY_BYTES (413: a request
    crosses to its replica in one message, and past the transport's limit it failed there as a
    503 to retry), not all there within BODY_TIMEOUT_S (408: a connection that stops sending held
    one of the ingress's ongoing requests, and enough of them held /readyz too), or a client gone
    before it was all there (a 400 no one reads, not a 500 with a traceback in the log)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyError(413, f"the request body has {declared} bytes, more than this server takes ({MAX_BODY_BYTES})")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise BodyError(413, f"the request body is more than this server takes ({MAX_BODY_BYTES} bytes)")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except ClientDisconnect:
        raise BodyError(400, "the client went away before its request body arrived") from None
    return b"".join(chunks)


async def _admin_json(request: Request, shape: str) -> dict | JSONResponse:
    """An admin call's body as a JSON object, or its 4xx: 400 naming the `shape` expected and what
    is wrong, 413 or 408 as for the OpenAI routes."""
    try:
        return await _json_body(request)
    except BodyError as e:
        detail = f"request body must be a JSON object: {shape} ({e})" if e.status == 400 else str(e)
        return JSONResponse({"detail": detail}, status_code=e.status)


async def _admin_body(request: Request, schema: type[BaseModel], shape: str) -> BaseModel | JSONResponse:
    """An admin call's body as `schema`, or the 400 naming what is wrong (the field, when one is)."""
    body = await _admin_json(request, shape)
    if isinstance(body, JSONResponse):
        return body
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        message, field = _validation_message(e, body)
        return JSONResponse({"detail": message, "field": field}, status_code=400)


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def finite(value):
    """The value with every NaN or infinity made null: JSON has no such numbers, and a status that
    holds one (a failed graph's verify diff, say) must still render, not answer 500."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


T = TypeVar("T")


async def until_taken(send: Callable[[], Awaitable[T]], turned_away: Callable[[T], bool], within_s: float) -> T:
    """send()'s answer, sent again while a replica turns it away (it is in its turn of a swap, or
    failed under it): Serve picks a replica each time; after within_s (swap_queue_timeout_s) the
    last answer stands."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        answer = await send()
        if not turned_away(answer) or asyncio.get_running_loop().time() > deadline:
            return answer
        await asyncio.sleep(SWAP_RETRY_S)


_REPLICA_GONE = Failure("the replica serving this request failed; retry the request", 503, retry=True)


async def _items(items) -> AsyncIterator[Item]:
    """The replica's items, decoded; a replica that fails or vanishes mid-request (a RayActorError,
    a lost connection) ends them with a Failure instead of an exception, so no client sees a 500 or
    a cut connection for it."""
    try:
        async for data in items:
            yield decode_item(data)
    except Exception:
        log.exception("the replica's stream failed")
        yield _REPLICA_GONE


async def _chain_items(first: ChoiceChunk, items: AsyncGenerator[Item]) -> AsyncIterator[Item]:
    """The first item, then the rest; leaving early (a client that went away) cancels the request
    in the engine."""
    try:
        yield first
        async for item in items:
            yield item
    finally:
        await items.aclose()


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    path: StrictStr = Field(min_length=1, max_length=MAX_PATH_CHARS, pattern=r"^[^\x00]+$")  # no path holds NUL

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_adapter_name(name)


@serve.ingress(api)
class Ingress:
    def __init__(self, llm, args: dict) -> None:
        send_app_logs_to_stderr()
        self.config = AppConfig.from_args(args).for_app(serve.get_replica_context().app_name)
        self.replicas = llm  # unary calls (adapter checks)
        self.llm = llm.options(stream=True)
        self.keys = api_keys_from_env(self.config)
        self.admin_tokens = admin_tokens_from_env(self.config)
        self.controller = ControllerClient(self.config)
        self.model_name = self.config.served_name()
        self.tenants = (
            set(self.config.tenants) | set(self.keys.values()) | ({auth.OPEN_TENANT} if not self.keys else set())
        )
        self.readiness = ReadinessView(lambda: self.controller.call(GraphController.replica_statuses))
        self._registered: dict[str, dict] = {}  # adapters registered through the admin API, as last read
        self._refused: dict[str, dict] = {}  # adapters the replicas refuse (`lora_refusals`), as last read
        self._registered_at = -math.inf
        self._reads = 0  # reads of the registry begun
        self._read_held = 0  # the read whose answer `_registered` holds (reads may end out of order)
        self._changed_at_read = 0  # reads begun when this ingress last added or removed an adapter
        self._shadowed_logged = False  # a registered adapter the served model's name shadows was logged
        self._sequences = 0  # sequences of the requests this ingress has under way (n each)
        if self.config.cors_allowed_origins:  # before Serve starts the app, which builds its middleware then
            api.add_middleware(
                CORSMiddleware,
                allow_origins=self.config.cors_allowed_origins,
                allow_methods=["GET", "POST", "PUT"],
                allow_headers=["*"],
                expose_headers=[SEED_HEADER, "Retry-After"],
            )

    async def _adapters(self) -> dict[str, str]:
        """Every adapter served, name -> path: the config's lora_modules and those registered
        through the admin API (read from the controller at most every toggle_poll_s, with the
        replicas' refusals; the last answer stands while it does not answer). A refused adapter
        is still routed: the replica loads it again, and says why it cannot serve it."""
        if self.config.lora is None:
            return {}
        now = asyncio.get_running_loop().time()
        if now - self._registered_at > self.config.toggle_poll_s:
            self._reads += 1
            read = self._reads
            try:
                registered = await self.controller.call(GraphController.get_lora_adapters)
                refused = await self.controller.call(GraphController.lora_refusals)
            except ControllerUnavailable:
                log.warning("the controller did not answer; serving the adapters it last listed")
            else:
                if read > self._read_held:  # an older answer never replaces a newer one
                    self._registered, self._refused, self._read_held = registered, refused, read
                if read > self._changed_at_read:  # begun after this ingress's last change: current
                    self._registered_at = now
        if self.model_name in self._registered and not self._shadowed_logged:
            self._shadowed_logged = True
            log.warning(
                "adapter %r, registered through the admin API, has the served model's name: the model is served "
                "under it (DELETE /admin/lora-adapters/%s removes the registration)",
                self.model_name,
                self.model_name,
            )
        return self.config.served_adapters(self._registered)

    # -- OpenAI API --------------------------------------------------------------------------------

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if auth.tenant_for(auth.bearer(request.headers.get("authorization")), self.keys) is None:
            return error_response(401, "invalid or missing API key")
        return JSONResponse({"object": "list", "data": await self._model_cards()})

    @api.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request) -> Response:
        """OpenAI's retrieve-model: the card /v1/models lists for it, or a 404."""
        if auth.tenant_for(auth.bearer(request.headers.get("authorization")), self.keys) is None:
            return error_response(401, "invalid or missing API key")
        card = next((c for c in await self._model_cards() if c["id"] == model), None)
        if card is None:
            return error_response(404, f"model {model!r} is not served here; /v1/models lists what is", "model")
        return JSONResponse(card)

    async def _model_cards(self) -> list[dict]:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "graphserve"}
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "graphserve",
                "root": path,
                "parent": self.model_name,
            }
            for name, path in sorted((await self._adapters()).items())
            if self._refusal(name, path) is None
        ]
        return [{**card, **await self._serving()}, *adapters]

    def _refusal(self, name: str, path: str) -> str | None:
        """Why the replicas refuse adapter `name` at `path` (as last read); None: they serve it."""
        refused = self._refused.get(name)
        return refused["reason"] if refused and refused["path"] == path else None

    async def _serving(self) -> dict:
        """What the READY replicas serve (it follows a model swap): checkpoint, revision(s) and
        max_model_len; nothing when the controller does not answer (the card alone is still right)."""
        try:
            statuses = await self.controller.call(GraphController.replica_statuses)
        except ControllerUnavailable:
            return {}
        ready = [s for _, s in sorted(statuses.items()) if s.get("state") == "READY"]
        if not ready:
            return {}
        revisions = sorted({s.get("model_revision") for s in ready})
        roots = sorted({s.get("model") or model_name(None) for s in ready})  # what each replica loaded
        return {
            "root": roots[0] if len(roots) == 1 else roots,
            "revision": revisions[0] if len(revisions) == 1 else revisions,
            "max_model_len": min(s.get("max_model_len", 0) for s in ready),
        }

    @api.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    @api.post("/v1/chat/completions", openapi_extra=_body(ChatRequest))
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatRequest)

    async def _generate(self, request: Request, schema: type[CompletionRequest] | type[ChatRequest]) -> Response:
        tenant = auth.tenant_for(auth.bearer(request.headers.get("authorization")), self.keys)
        if tenant is None:
            return error_response(401, "invalid or missing API key")
        try:
            body = await _json_body(request)
        except BodyError as e:
            return error_response(e.status, str(e))
        try:
            req = await validated(schema, body)
        except ValidationError as e:
            return error_response(400, *_validation_message(e, body))
        adapter = None
        if req.model != self.model_name:
            path = (await self._adapters()).get(req.model)
            if path is None:
                return error_response(
                    404,
                    f"model {req.model!r} is not served here; try {self.model_name!r} or an adapter /v1/models lists",
                    "model",
                )
            adapter = (req.model, path)
        self.readiness.keep_fresh()
        serving = await self.readiness.serving()
        if not serving and self.readiness.known:  # unknown (the controller never answered): Serve routes
            return error_response(503, "no replica has finished capturing its graphs yet", headers=RETRY_AFTER)
        chat = schema is ChatRequest
        try:
            sampling = req.sampling()
        except InvalidRequest as e:
            return error_response(400, str(e))
        payload = GenerateRequest(
            tenant,
            "chat" if chat else "completion",
            sampling,
            req.requested_max_tokens(),
            req.max_tokens_field(),
            req.n,
            prompt=None if chat else req.prompt,
            messages=[m.for_template() for m in req.messages] if chat else None,
            adapter=adapter,
            not_serving=tuple(sorted(self.readiness.not_serving())),
        )
        try:
            encode(payload)
        except (OverflowError, msgspec.EncodeError) as e:  # an integer no engine could hold (a token id of 2**70)
            return error_response(400, f"a number in the request is out of range: {e}", out_of_range(body))
        if not admits(self._sequences, req.n, len(serving) or 1, self.config.max_num_seqs, self.config.max_waiting):
            return error_response(
                503,
                f"the server is at capacity ({self._sequences} sequences under way through this ingress: "
                "max_num_seqs plus max_waiting per replica serving, and max_waiting more); retry later",
                headers=RETRY_AFTER,
            )
        adapter_name = adapter[0] if adapter else None
        items = self._resumable(payload, adapter_name) if req.n == 1 else self._choices(payload, adapter_name)
        items = self._counted(items, req.n)
        first = await anext(items)
        if isinstance(first, Failure):
            await items.aclose()
            return error_response(first.status, first.error, first.param, RETRY_AFTER if first.status == 503 else None)
        shape = ResponseShape(chat, req.model, req.n, sampling.logprobs is not None)
        seed = {SEED_HEADER: str(first.seed)}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(shape, first, items, include_usage),
                media_type="text/event-stream",
                headers=seed | UNBUFFERED,
            )
        response = await self._collect(shape, first, items)
        response.headers.update(seed)
        return response

    async def _counted(self, items: AsyncGenerator[Item], n: int) -> AsyncGenerator[Item]:
        """`items`, its request's n sequences counted as under way until they end or are left."""
        self._sequences += n
        try:
            async for item in items:
                yield item
        finally:
            self._sequences -= n
            await items.aclose()

    async def _resumable(
        self,
        payload: GenerateRequest,
        adapter: str | None,
        progress: Progress | None = None,
        failure: Failure = _REPLICA_GONE,
    ) -> AsyncGenerator[Item]:
        """The request's items, from one replica or, when it or its engine fails, from another that
        goes on where the client is (`app/failover.py`): with another replica serving, at most
        MAX_FAILOVERS times, each continuation's first item within FAILOVER_TIMEOUT_S. Otherwise the
        failure ends the items as it did before failover (an error item). With `progress` (and the
        `failure` that ended its last attempt), a request already under way goes on."""
        progress = progress or Progress()
        while True:
            try:
                async with asyncio.timeout(FAILOVER_TIMEOUT_S if progress.failovers else None):
                    items, item = await self._first_item(progress.payload(payload), adapter)
            except TimeoutError:
                log.warning("no replica continued the request within %g s", FAILOVER_TIMEOUT_S)
                yield failure
                return
            rest = _items(items)
            try:
                item = item or _REPLICA_GONE
                while isinstance(item, ChoiceChunk):
                    progress.record(item)
                    yield item
                    if item.finish_reason is not None:
                        return
                    item = await anext(rest, _REPLICA_GONE)  # a stream that stops short: its replica is gone
            finally:
                items.cancel()
            failure = item
            if not await self._fails_over(progress, failure):
                yield failure
                return

    async def _choices(self, payload: GenerateRequest, adapter: str | None) -> AsyncGenerator[Item]:
        """The items of a request with n > 1 choices: all of them from one replica, side by side;
        when it or its engine fails, each unfinished choice goes on by itself (`_resumable` of
        `one_choice`, from that choice's progress), its items under its index."""
        n = payload.n
        progress, finished = [Progress() for _ in range(n)], set()
        items, item = await self._first_item(payload, adapter)
        rest = _items(items)
        try:
            item = item or _REPLICA_GONE
            while isinstance(item, ChoiceChunk):
                progress[item.index].record(item)
                yield item
                if item.finish_reason is not None:
                    finished.add(item.index)
                    if len(finished) == n:
                        return
                item = await anext(rest, _REPLICA_GONE)
        finally:
            items.cancel()
        going_on = [i for i in range(n) if i not in finished]
        replica = item.replica_id or next((p.replica_id for p in progress if p.replica_id), None)
        failure = msgspec.structs.replace(item, replica_id=replica)  # avoided by every choice, those with no chunk too
        if not all([await self._fails_over(progress[i], failure) for i in going_on]):
            yield item
            return
        seeded = with_request_seed(payload, progress[0].seed)
        continued = {i: self._resumable(one_choice(seeded, i), adapter, progress[i], item) for i in going_on}
        async for i, choice_item in merged(continued):
            if isinstance(choice_item, Failure):
                yield choice_item
                return
            yield msgspec.structs.replace(choice_item, index=i)

    async def _fails_over(self, progress: Progress, failure: Failure) -> bool:
        """Whether a failed attempt goes on elsewhere: a replica or engine failure, within the
        bound, with another replica serving. A failure before any item that names no replica (its
        stream broke in transport) may have been the one replica serving: then it does not go on
        (it went back to that replica, up to MAX_FAILOVERS times)."""
        known = (failure.replica_id or progress.replica_id) is not None
        if not progress.fail(failure):
            return False
        if len(await self.readiness.serving() - set(progress.avoid)) < (1 if known else 2):
            return False
        log.warning(
            "request fails over to another replica after %d tokens: %s", len(progress.output_ids), failure.error
        )
        return True

    async def _first_item(self, payload: GenerateRequest, adapter: str | None = None) -> tuple[object, Item | None]:
        """Send the request to a replica and wait for its first item. A replica that is swapping its
        model turns requests away: they are sent again (`until_taken`). A request for an adapter
        goes through Serve's model multiplexing, which prefers replicas that have served it lately
        (so hold it in a slot)."""
        llm = self.llm.options(multiplexed_model_id=adapter) if adapter else self.llm
        data = encode(payload)  # once: a swapping replica's refusal sends the same bytes again

        async def attempt() -> tuple[object, Item | None]:
            items = llm.generate.remote(data)
            try:
                return items, await anext(_items(items), None)
            except BaseException:  # the client went away before the first token: end the request there too
                items.cancel()
                raise

        return await until_taken(
            attempt, lambda sent: isinstance(sent[1], Failure) and sent[1].swapping, self.config.swap_queue_timeout_s
        )

    async def _stream(
        self, shape: ResponseShape, first: ChoiceChunk, items, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """SSE events, one write per item; the final chunk, the usage and [DONE] leave in one write
        (every write is an item through the proxy, and at high concurrency streams end together).
        With n choices, items carry their choice's index and the last choice to end sends the final
        chunk. A stream the server cannot finish ends with an error event in OpenAI's shape, then [DONE]."""
        tail, started, ended, completion_tokens, cached = b"", set(), set(), {}, {}
        async for item in _chain_items(first, items):
            if isinstance(item, Failure):
                yield _sse(error_body(item.status, item.error, item.param)) + _sse("[DONE]")
                return
            index = item.index
            completion_tokens[index] = item.completion_tokens
            cached.setdefault(index, item.cached_tokens)  # the first prefill's, as `Choice` keeps
            opening = index not in started
            if item.text or opening or item.finish_reason is not None or item.logprobs:
                started.add(index)
                event = _sse(shape.chunk(item.text, item.finish_reason, opening, index, item.logprobs))
                if item.finish_reason is not None:
                    ended.add(index)
                if len(ended) < shape.n:
                    yield event
                else:
                    tail = event
        if len(ended) < shape.n:  # the replica's stream stopped short of its end
            yield _sse(error_body(_REPLICA_GONE.status, _REPLICA_GONE.error)) + _sse("[DONE]")
            return
        if include_usage:
            tail += _sse(shape.usage_chunk(first.prompt_tokens, sum(completion_tokens.values()), cached))
        yield tail + _sse("[DONE]")

    async def _collect(self, shape: ResponseShape, first: ChoiceChunk, items) -> Response:
        """The whole completion, or a 503 with Retry-After when the server could not finish it."""
        choices = [Choice() for _ in range(shape.n)]
        async for item in _chain_items(first, items):
            if isinstance(item, Failure):
                return error_response(item.status, item.error, item.param, RETRY_AFTER if item.status == 503 else None)
            choices[item.index].add(item)
        if any(c.finish_reason is None for c in choices):
            return error_response(_REPLICA_GONE.status, _REPLICA_GONE.error, headers=RETRY_AFTER)
        return JSONResponse(shape.whole(choices, first.prompt_tokens))

    # -- admin API ---------------------------------------------------------------------------------

    def _admin_denied(self, request: Request) -> JSONResponse | None:
        """None when the bearer token is an operator's (then request.state.operator, an
        `auth.Operator`, says whose and from where), else the 4xx refusal (logged by auth.authorize_admin,
        without the token)."""
        env = f"{self.config.admin_tokens_env} or {self.config.admin_token_env}"
        client = request.client.host if request.client else "unknown"
        result = auth.authorize_admin(
            request.headers.get("authorization"),
            self.admin_tokens,
            f"set {env} on the Serve processes to enable it",
            client,
            request.url.path,
        )
        if isinstance(result, auth.AdminRefusal):
            return JSONResponse({"detail": result.detail}, status_code=result.status)
        request.state.operator = result
        return None

    def _unknown_tenant(self, tenant: str) -> JSONResponse | None:
        if tenant in self.tenants:
            return None
        return JSONResponse({"detail": f"unknown tenant {tenant!r}; known: {sorted(self.tenants)}"}, status_code=404)

    @api.get("/admin/tenants/{tenant}/cuda-graph")
    async def get_toggle(self, tenant: str, request: Request) -> Response:
        denied = self._admin_denied(request) or self._unknown_tenant(tenant)
        return denied or JSONResponse(await self.controller.call(GraphController.tenant, tenant))

    @api.put("/admin/tenants/{tenant}/cuda-graph")
    async def put_toggle(self, tenant: str, request: Request) -> Response:
        denied = self._admin_denied(request) or self._unknown_tenant(tenant)
        if denied:
            return denied
        body = await _admin_json(request, '{"cuda_graph": true|false}')
        if isinstance(body, JSONResponse):
            return body
        try:
            toggle = ToggleBody.model_validate(body)
        except ValidationError as e:
            return JSONResponse({"detail": _validation_message(e, body)[0]}, status_code=400)
        # The audit names the operator whose token this is; no header the caller chooses is trusted.
        result = await self.controller.call(
            GraphController.set_toggle, tenant, toggle.cuda_graph, request.state.operator
        )
        if "error" in result:
            return JSONResponse({"detail": result["error"]}, status_code=409)
        return JSONResponse(result)

    @api.get("/admin/status")
    async def status(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied:
            return denied
        statuses, (_, toggles) = await asyncio.gather(
            self.controller.call(GraphController.replica_statuses), self.controller.call(GraphController.get_toggles)
        )
        return JSONResponse(finite({"model": self.model_name, "tenants": toggles, "replicas": statuses}))

    @api.post("/admin/rollouts")
    async def start_rollout(self, request: Request) -> Response:
        """Start a gradual rollout of graph mode (the body is its plan); 409 while one is running."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        body = await _admin_json(request, "a rollout plan")
        if isinstance(body, JSONResponse):
            return body
        return _rollout_response(
            await self.controller.call(GraphController.start_rollout, body, request.state.operator),
            201,
        )

    @api.get("/admin/rollouts/current")
    async def current_rollout(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied:
            return denied
        rollout = await self.controller.call(GraphController.current_rollout)
        if rollout is None:
            return JSONResponse({"detail": "no rollout has been started"}, status_code=404)
        return JSONResponse(finite(rollout))

    @api.post("/admin/rollouts/current/{action}")
    async def rollout_action(self, action: str, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied:
            return denied
        if action not in ROLLOUT_ACTIONS:
            return JSONResponse(
                {"detail": f"unknown rollout action {action!r}; known: {', '.join(ROLLOUT_ACTIONS)}"}, status_code=404
            )
        return _rollout_response(
            await self.controller.call(GraphController.rollout_action, action, request.state.operator),
            200,
        )

    @api.post("/admin/model")
    async def start_swap(self, request: Request) -> Response:
        """Swap every replica to another checkpoint, one at a time, gated (202 with the swap)."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        body = await _admin_json(request, '{"model": "<checkpoint dir>"}')
        if isinstance(body, JSONResponse):
            return body
        previous = {"model": self.config.model, "revision": self.config.model_revision}
        result = await self.controller.call(GraphController.start_swap, "model", body, previous, request.state.operator)
        return _swap_response(result)

    @api.put("/admin/graph-policy")
    async def put_graph_policy(self, request: Request) -> Response:
        """Rebuild every replica's graphs under a new graph policy, the same rolling, gated way."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        policy = await _admin_body(request, GraphPolicy, "a graph policy")
        if isinstance(policy, JSONResponse):
            return policy
        try:
            policy.check_fits(self.config.max_num_seqs)
        except ValueError as e:
            return JSONResponse({"detail": str(e), "field": "decode_batch_buckets"}, status_code=400)
        previous = {"graph_policy": self.config.graph_policy().model_dump(mode="json")}
        result = await self.controller.call(
            GraphController.start_swap,
            "graph_policy",
            policy.model_dump(mode="json"),
            previous,
            request.state.operator,
        )
        return _swap_response(result)

    @api.get("/admin/model")
    async def model(self, request: Request) -> Response:
        """The model each replica serves (checkpoint revision, state) and the latest swap, if any."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        swap, statuses = await asyncio.gather(
            self.controller.call(GraphController.current_swap), self.controller.call(GraphController.replica_statuses)
        )
        fields = ("state", "model", "model_revision", "model_fallback", "max_model_len", "swap")
        replicas = {rid: {f: st.get(f) for f in fields} for rid, st in statuses.items()}
        configured = {"model": self.config.model, "revision": self.config.model_revision}
        return JSONResponse(
            finite({"served_model_name": self.model_name, "configured": configured, "replicas": replicas, "swap": swap})
        )

    @api.get("/admin/buckets/recommendation")
    async def bucket_recommendation(self, request: Request) -> Response:
        """Bucket sizes fitted to the live batch-size distribution (apply them with PUT
        /admin/graph-policy)."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        raw = request.query_params.get("max_buckets")
        if raw is not None and not (re.fullmatch("[0-9]{1,3}", raw) and 1 <= int(raw) <= MAX_RECOMMENDED_BUCKETS):
            return JSONResponse(
                {"detail": f"max_buckets must be an integer from 1 to {MAX_RECOMMENDED_BUCKETS}, got {raw[:40]!r}"},
                status_code=400,
            )
        result = await self.controller.call(
            GraphController.bucket_recommendation, int(raw) if raw is not None else None
        )
        if "error" in result:
            return JSONResponse({"detail": result["error"]}, status_code=result["status"])
        return JSONResponse(finite(result))

    @api.get("/admin/lora-adapters")
    async def lora_adapters(self, request: Request) -> Response:
        """Every adapter served (from the config or registered), which replicas hold it in a slot,
        and why the replicas refuse one they cannot serve with these limits."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        if self.config.lora is None:
            return JSONResponse({"lora": None, "adapters": []})
        paths = await self._adapters()
        statuses = await self.controller.call(GraphController.replica_statuses)
        held: dict[str, dict] = {}
        for rid, status in sorted(statuses.items()):
            for name, slot in ((status.get("lora") or {}).get("adapters") or {}).items():
                held.setdefault(name, {})[rid] = slot
        adapters = [
            {
                "name": name,
                "path": path,
                **(
                    {"source": "config"}
                    if name in self.config.lora_modules
                    else {"source": "admin", **{k: v for k, v in self._registered[name].items() if k != "path"}}
                ),
                "replicas": held.get(name, {}),
                **({"refused": why} if (why := self._refusal(name, path)) else {}),
            }
            for name, path in sorted(paths.items())
        ]
        return JSONResponse(finite({"lora": self.config.lora.model_dump(), "adapters": adapters}))

    @api.post("/admin/lora-adapters")
    async def add_lora_adapter(self, request: Request) -> Response:
        """Register an adapter once a replica has loaded and verified it (201); 400 says why not."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        if self.config.lora is None:
            return JSONResponse(
                {"detail": "LoRA is not enabled: set lora: {max_loras, max_lora_rank} in the config"}, status_code=400
            )
        adapter = await _admin_body(request, AdapterBody, '{"name", "path"}')
        if isinstance(adapter, JSONResponse):
            return adapter
        if adapter.name == self.model_name:
            return JSONResponse({"detail": f"name: {adapter.name!r} is the served model's name"}, status_code=400)
        if adapter.name in self.config.lora_modules:
            return JSONResponse(
                {"detail": f"adapter {adapter.name!r} is defined in the config's lora_modules; change it there"},
                status_code=409,
            )
        try:
            check = await self._checked_adapter(adapter.name, adapter.path)
        except TimeoutError:
            return JSONResponse(
                {"detail": "no replica checked the adapter in time; retry"}, status_code=503, headers=RETRY_AFTER
            )
        if "error" in check:
            retry = RETRY_AFTER if check["status"] == 503 else None
            return JSONResponse({"detail": check["error"]}, status_code=check["status"], headers=retry)
        result = await self.controller.call(
            GraphController.add_lora_adapter, adapter.name, adapter.path, request.state.operator
        )
        if "error" in result:
            return JSONResponse({"detail": result["error"]}, status_code=409)
        self._registry_changed()
        return JSONResponse({**result, "checked_by": check}, status_code=201)

    def _registry_changed(self) -> None:
        """An adapter was added or removed through this ingress: the next request reads the registry
        again, and a read begun before (a request's, still awaiting the controller) may hold the
        registry as it was, so its answer is not taken as current. Without this, such a read
        ending after an add put the old registry back for toggle_poll_s: the added adapter was a
        404 right after its 201."""
        self._registered_at = -math.inf
        self._changed_at_read = self._reads

    async def _checked_adapter(self, name: str, path: str) -> dict:
        """A replica's check of the adapter (`LLMReplica.check_adapter`). A replica in its turn of a
        swap cannot check it, and one that fails under it (dies: a RayActorError) answers nothing:
        the check is sent again (`until_taken`) before the 503 stands."""
        replicas = self.replicas.options(multiplexed_model_id=name)

        async def attempt() -> dict:
            try:
                return await asyncio.wait_for(
                    replicas.check_adapter.remote(name, path), self.config.engine_start_timeout_s
                )
            except TimeoutError:
                raise
            except Exception as e:
                log.warning("the replica checking adapter %r failed: %r", name, e)
                return {"error": "the replica checking the adapter failed; retry", "status": 503, "failed": True}

        return await until_taken(
            attempt, lambda check: check.get("swapping") or check.get("failed"), self.config.swap_queue_timeout_s
        )

    @api.delete("/admin/lora-adapters/{name}")
    async def remove_lora_adapter(self, name: str, request: Request) -> Response:
        """Stop serving an adapter: new requests for it get 404; running ones finish with it."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        if name in self.config.lora_modules:
            return JSONResponse(
                {"detail": f"adapter {name!r} is defined in the config's lora_modules; remove it there"},
                status_code=409,
            )
        result = await self.controller.call(GraphController.remove_lora_adapter, name, request.state.operator)
        if "error" in result:
            return JSONResponse({"detail": result["error"]}, status_code=result["status"])
        self._registry_changed()
        return JSONResponse(result)

    @api.get("/admin/audit")
    async def audit(self, request: Request) -> Response:
        """The latest `limit` audit entries (default 100), oldest first; the controller keeps the last
        AUDIT_KEEP."""
        denied = self._admin_denied(request)
        if denied:
            return denied
        raw = request.query_params.get("limit", str(DEFAULT_AUDIT_ENTRIES))
        if not (re.fullmatch("[0-9]{1,4}", raw) and 1 <= int(raw) <= AUDIT_KEEP):
            return JSONResponse(
                {"detail": f"limit must be an integer from 1 to {AUDIT_KEEP}, got {raw[:40]!r}"}, status_code=400
            )
        return JSONResponse({"audit": await self.controller.call(GraphController.audit_log, int(raw))})

    # -- health, readiness, metrics ----------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> Response:
        return JSONResponse({"status": "ok"})

    @api.get("/readyz")
    async def readyz(self) -> Response:
        if await self.readiness.any_ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "no replica has finished capture"}, status_code=503, headers=RETRY_AFTER)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        statuses, rollout = await asyncio.gather(
            self.controller.call(GraphController.replica_statuses),
            self.controller.call(GraphController.current_rollout),
        )
        body = render(statuses, rollout)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
