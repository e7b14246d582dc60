"""HTTP API of the conductor (FastAPI; OpenAPI at ``/openapi.json``), Mooncake's field names.

Endpoints: ``POST /register``, ``POST /unregister``, ``POST /query`` (token ids),
``POST /query_by_hash`` (64-bit block hashes), ``GET /instances``, ``GET /health``,
``GET /metrics``. Request/response schemas live here only. Errors map from the kvplane tree:
InvalidArgument 400, Unauthorized 401, NotFound 404, Conflict 409, oversized body 413,
schema violations 422. Every request body is capped (``max_request_bytes``). The token
(``Authorization: Bearer <token>`` or ``X-KVPlane-Token``, every endpoint but ``/health``) is
checked in front of the app, before any body is read, by the token gate of
``kvplane.common.http`` that ``server.py`` installs.

Must not bind sockets (``server.py`` does) nor import ``zmq``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from kvplane.common import metrics as common_metrics
from kvplane.common.errors import (
    Conflict,
    InvalidArgument,
    KVPlaneError,
    NotFound,
    ProtocolError,
    Unauthorized,
)
from kvplane.conductor import instruments
from kvplane.conductor.hashing import HashProfile, native
from kvplane.conductor.service import Conductor, QueryRequest, Registration

Secret = Annotated[str, Field(max_length=4096)]
Name = Annotated[str, Field(max_length=256)]
Endpoint = Annotated[str, Field(max_length=512, pattern=r"^(tcp|ipc|inproc)://")]
Token = Annotated[int, Field(ge=0, lt=1 << 32)]
Hash64 = Annotated[int, Field(ge=0, lt=1 << 64)]
BlockSize = Annotated[int, Field(ge=1, le=1 << 16)]
_STATUS = ((Unauthorized, 401), (NotFound, 404), (Conflict, 409), (ProtocolError, 413),
           (InvalidArgument, 400))


class HashProfileBody(BaseModel):
    """Mooncake's hash profile: how the engine hashes blocks."""

    model_config = ConfigDict(extra="forbid")
    strategy: Literal["vllm_v1", "vllm_v1_tagged"] = "vllm_v1"
    algorithm: Literal["sha256", "sha256_cbor"] = "sha256"
    python_hash_seed: Name = "0"
    index_projection: Literal["low64_be"] = "low64_be"


class RegisterBody(BaseModel):
    """``POST /register``: one engine instance (or shared pool) and its event endpoints."""

    endpoint: Endpoint | None = Field(None, description="engine ZMQ PUB endpoint to connect to; "
                                      "omit when the engine connects to the conductor's --bind")
    replay_endpoint: Endpoint | None = Field(None, description="engine ZMQ ROUTER replay endpoint")
    type: Name = Field("vLLM", description="vLLM | SGLang | Mooncake | kvplane (last two: shared pool)")
    modelname: Name
    lora_name: Name | None = ""
    tenant_id: Name = "default"
    instance_id: Annotated[str, Field(min_length=1, max_length=256)]
    block_size: BlockSize
    dp_rank: Annotated[int, Field(ge=0, le=1 << 16)] = 0
    dp_size: Annotated[int, Field(ge=1, le=1024)] = 1
    additionalsalt: Name = ""
    topic: Name = Field("", description="publisher topic (routes messages on a bound SUB)")
    hash_profile: HashProfileBody | None = None
    token: Secret = Field("", description="token presented (ZMQ PLAIN) to a publisher that "
                          "requires one: a kvplane master's KV-event stream; never shown back")


class UnregisterBody(BaseModel):
    """``POST /unregister``: drop an instance (all ranks unless ``dp_rank`` is given)."""

    type: Name | None = None
    modelname: Name | None = None
    lora_name: Name | None = None
    tenant_id: Name = "default"
    instance_id: Annotated[str, Field(min_length=1, max_length=256)]
    block_size: BlockSize | None = None
    dp_rank: Annotated[int, Field(ge=0, le=1 << 16)] | None = None


class _QueryBase(BaseModel):
    model: Name
    lora_name: Name | None = ""
    lora_id: int | None = Field(None, description="deprecated, ignored")
    tenant_id: Name = "default"
    instance_id: Name | None = None
    block_size: BlockSize | None = None
    cache_salt: Name | None = None
    additionalsalt: Name = ""
    lora_path: Annotated[str, Field(max_length=4096)] | None = Field(
        None, description="adapter path, hashed with the name by strategy vllm_v1_tagged")


class QueryBody(_QueryBase):
    """``POST /query``: prompt token ids; only complete blocks count."""

    token_ids: list[Token]


class QueryByHashBody(_QueryBase):
    """``POST /query_by_hash``: 64-bit hashes of consecutive blocks (alias ``block_hash``)."""

    model_config = ConfigDict(populate_by_name=True)
    seq_hashes: list[Hash64] = Field(validation_alias=AliasChoices("seq_hashes", "block_hash"))


class _QueryWire(msgspec.Struct, kw_only=True):
    """Fast decoder for both query bodies (JSON or msgpack); mirrors QueryBody/QueryByHashBody."""

    model: Annotated[str, msgspec.Meta(max_length=256)]
    token_ids: list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]] | None = None
    seq_hashes: list[int] | None = None  # range-checked in _decode_query (msgspec: int64 bounds)
    block_hash: list[int] | None = None
    lora_name: Annotated[str, msgspec.Meta(max_length=256)] | None = ""
    lora_id: int | None = None
    tenant_id: Annotated[str, msgspec.Meta(max_length=256)] = "default"
    instance_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    additionalsalt: Annotated[str, msgspec.Meta(max_length=256)] = ""
    lora_path: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


_PLAIN_JSON_QUERY = msgspec.json.Decoder(_QueryWire)
_MSGPACK_QUERY = msgspec.msgpack.Decoder(_QueryWire)


def _decode_json(body: bytes) -> _QueryWire:
    """A JSON query body. With the C accelerator its token ids are parsed from their text in
    one pass over the body (32k ids in about 0.19 ms, against 0.47 ms when msgspec first skipped
    them as raw text and 0.8-1.6 ms as Python ints); the rest of the body, with the ids' array
    replaced by ``null``, is decoded by msgspec. A body it does not take (no array, an
    out-of-range or non-integer id, an escaped key, a syntax error anywhere) is decoded again as
    a whole by msgspec, so validation and error messages are exactly those of the plain decoder."""
    # no C scan of a body that cannot hold the ids (a /query_by_hash body: its hashes alone
    # would cost the scan more than msgspec's whole decode)
    found = None if native is None or b'"token_ids"' not in body else native.query_ids(body)
    if found is None:  # no ids, null, or not ours: msgspec decides
        return _PLAIN_JSON_QUERY.decode(body)
    start, stop, ids = found
    try:
        q = _PLAIN_JSON_QUERY.decode(b"".join((body[:start], b"null", body[stop:])))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _PLAIN_JSON_QUERY.decode(body)  # raises, with the plain decoder's message
    q.token_ids = np.frombuffer(ids, np.int64)  # type: ignore[assignment]  # the wire struct holds ids as a list or an array
    return q


def _decode_query(body: bytes, content_type: str, by_hash: bool) -> QueryRequest:
    """Decode a query body; JSON unless the content type says msgpack.

    Raises:
        RequestValidationError: on a malformed body or schema violation (answered with 422).
    """
    try:
        q = _MSGPACK_QUERY.decode(body) if "msgpack" in content_type else _decode_json(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RequestValidationError([{"type": "body", "loc": ["body"], "msg": str(exc)}]) from exc
    hashes = q.seq_hashes if q.seq_hashes is not None else q.block_hash
    if hashes and (min(hashes) < 0 or max(hashes) >> 64):
        raise RequestValidationError([{"type": "value_error", "loc": ["body", "seq_hashes"],
                                       "msg": "hashes must be unsigned 64-bit integers"}])
    field = "seq_hashes" if by_hash else "token_ids"
    if (hashes if by_hash else q.token_ids) is None:
        raise RequestValidationError([{"type": "missing", "loc": ["body", field],
                                       "msg": f"{field} is required"}])
    return QueryRequest(model=q.model, token_ids=None if by_hash else q.token_ids,
                        seq_hashes=hashes if by_hash else None, lora_name=q.lora_name or "",
                        tenant_id=q.tenant_id, instance_id=q.instance_id,
                        block_size=q.block_size, cache_salt=q.cache_salt,
                        additional_salt=q.additionalsalt, lora_path=q.lora_path)


def _json(answer: Any) -> Response:
    """A query answer as JSON (msgspec; FastAPI's response_model pass is documentation only)."""
    return Response(msgspec.json.encode(answer), media_type="application/json")


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    content = {"schema": schema}
    return {"requestBody": {"required": True, "content": {"application/json": content,
                                                          "application/msgpack": content}}}


class _TierMatch(BaseModel):
    longest_matched: int
    GPU: int
    CPU: int
    DISK: int
    DP: dict[str, int]


QueryResponse = dict[str, dict[str, _TierMatch]]


def _profile(body: HashProfileBody | None) -> HashProfile | None:
    if body is None:
        return None
    return HashProfile(body.algorithm, body.python_hash_seed, body.strategy, body.index_projection)


def to_registration(body: RegisterBody | dict[str, Any]) -> Registration:
    """Validate a ``/register`` body (model or plain dict) into a :class:`Registration`.

    Raises:
        InvalidArgument: when the body does not match the schema.
    """
    if isinstance(body, dict):
        try:
            body = RegisterBody.model_validate(body)
        except ValueError as exc:
            raise InvalidArgument(f"bad registration: {exc}") from exc
    return Registration(instance_id=body.instance_id, model=body.modelname,
                        block_size=body.block_size, endpoint=body.endpoint,
                        replay_endpoint=body.replay_endpoint, type=body.type,
                        lora_name=body.lora_name or "", tenant_id=body.tenant_id,
                        dp_rank=body.dp_rank, dp_size=body.dp_size,
                        additional_salt=body.additionalsalt, topic=body.topic,
                        hash_profile=_profile(body.hash_profile), token=body.token)


class _BodyLimit:
    """ASGI middleware: reject bodies larger than ``limit`` bytes with 413, before parsing."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and (not v.isdigit() or int(v) > self.limit):
                await JSONResponse({"detail": "request body too large"}, 413)(scope, receive, send)
                return
        chunks: list[bytes] = []
        seen, more = 0, True
        while more:  # buffer the (bounded) body so an overrun can still be answered with 413
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            more = msg.get("more_body", False)
            if seen > self.limit:
                await JSONResponse({"detail": "request body too large"}, 413)(scope, receive, send)
                return
        body, sent = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def create_app(conductor: Conductor) -> FastAPI:
    """Build the FastAPI app serving ``conductor`` (token and body limits from its config)."""
    cfg = conductor.config
    app = FastAPI(title="kvplane conductor", version="1",
                  description="Global KV cache index fed by vLLM KV events (Mooncake-compatible).")

    @app.exception_handler(KVPlaneError)
    async def _kv_error(_: Request, exc: KVPlaneError) -> JSONResponse:
        return JSONResponse(*_kv_error_body(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(*_invalid_body(exc))

    _admin_routes(app, conductor, [])
    _query_routes(app, conductor, [])
    app.add_middleware(_QueryFastPath, conductor=conductor)
    app.add_middleware(_BodyLimit, limit=cfg.max_request_bytes)
    return app


def _kv_error_body(exc: KVPlaneError) -> tuple[dict[str, Any], int]:
    status = next((s for cls, s in _STATUS if isinstance(exc, cls)), 400)
    return {"detail": str(exc), "code": exc.code}, status


def _invalid_body(exc: RequestValidationError) -> tuple[dict[str, Any], int]:
    # FastAPI's default handler echoes the raw input and crashes (500) on non-UTF-8 bytes
    errors = [{"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")),
               "type": str(e.get("type", ""))} for e in exc.errors()]
    return {"detail": errors}, 422


class _QueryFastPath:
    """ASGI middleware: ``POST /query`` and ``/query_by_hash`` without FastAPI's per-request work.

    Same decoding, answer and error bodies as the routes of :func:`_query_routes` (which stay
    for the OpenAPI schema); it skips the request object and the response-model pass. The token
    gate in front of the app has already checked the token. Other paths and methods go to the
    app.
    """

    _PATHS = {"/query": False, "/query_by_hash": True}

    def __init__(self, app: Any, conductor: Conductor) -> None:
        self.app, self.conductor = app, conductor

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        by_hash = self._PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if by_hash is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        try:
            body = await _read_body(receive)
            if body is None:
                return  # the client went away before sending its body
            req = _decode_query(body, headers.get(b"content-type", ""), by_hash=by_hash)
            payload, status = msgspec.json.encode(self.conductor.query(req)), 200
        except KVPlaneError as exc:
            answer, status = _kv_error_body(exc)
            payload = msgspec.json.encode(answer)
        except RequestValidationError as exc:
            answer, status = _invalid_body(exc)
            payload = msgspec.json.encode(answer)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive: Any) -> bytes | None:
    """The whole request body (already bounded by _BodyLimit), or None on a disconnect."""
    chunks, more = [], True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(chunks)


def _admin_routes(app: FastAPI, conductor: Conductor, guarded: list[Any]) -> None:
    @app.post("/register", dependencies=guarded)
    def register(body: RegisterBody) -> dict[str, Any]:
        """Register an engine instance (all its DP ranks) or a shared KV pool."""
        streams = conductor.register(to_registration(body))
        return {"status": "registered successfully", "instance_id": body.instance_id,
                "dp_ranks": [s.dp_rank for s in streams]}

    @app.post("/unregister", dependencies=guarded)
    def unregister(body: UnregisterBody) -> dict[str, Any]:
        """Remove an instance (or one DP rank) and forget its blocks."""
        removed = conductor.unregister(body.instance_id, body.tenant_id, body.dp_rank)
        return {"status": "unregistered successfully", "removed_instances": removed}

    @app.get("/instances", dependencies=guarded)
    def instances() -> list[dict[str, Any]]:
        """Every registered (instance, DP rank) with endpoints, hash status and block counts."""
        return conductor.instances()

    @app.get("/health")
    def health() -> dict[str, Any]:
        """Liveness and index sizes; ``degraded`` while a stream's hash profile mismatches."""
        return conductor.health()

    @app.get("/metrics", dependencies=guarded)
    def metrics() -> Response:
        """Prometheus exposition of the process's metrics."""
        h = conductor.health()
        for what in ("contexts", "blocks", "entries", "holders"):
            instruments.INDEX_SIZE.labels(what=what).set(h[what])  # type: ignore[arg-type]  # health() values are numbers
        instruments.STREAMS.set(h["streams"])  # type: ignore[arg-type]  # health() values are numbers
        body, ctype = common_metrics.render()
        return Response(body, media_type=ctype)


def _query_routes(app: FastAPI, conductor: Conductor, guarded: list[Any]) -> None:
    @app.post("/query", dependencies=guarded, response_model=QueryResponse,
              openapi_extra=_body_doc(QueryBody))
    async def query(request: Request) -> Any:
        """Longest cached prefix per instance and tier for prompt token ids (JSON or msgpack)."""
        body = await request.body()
        req = _decode_query(body, request.headers.get("content-type", ""), by_hash=False)
        return _json(conductor.query(req))

    @app.post("/query_by_hash", dependencies=guarded, response_model=QueryResponse,
              openapi_extra=_body_doc(QueryByHashBody))
    async def query_by_hash(request: Request) -> Any:
        """Longest cached prefix per instance and tier for u64 block hashes (JSON or msgpack)."""
        body = await request.body()
        req = _decode_query(body, request.headers.get("content-type", ""), by_hash=True)
        return _json(conductor.query(req))
