"""Every error the gateway returns, mapped to an HTTP status; the envelope is the protocol's own
(`gateway.api.adapter`: the app's protocols know which one a path belongs to)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.base import (
    ContextLengthExceeded,
    EngineClosed,
    EngineCrashed,
    EngineError,
    EngineOverloaded,
    InvalidGenerationRequest,
    ModelLoadError,
    ModelNotAvailable,
    ModelTooLarge,
    NoRoom,
)
from gateway.api.admission import GateClosed, Rejected
from gateway.api.openai.protocol import ErrorBody, ErrorResponse

if TYPE_CHECKING:
    from gateway.metrics import RequestObserver

log = logging.getLogger(__name__)

# The id of the request being served (set by gateway.api.guards), for log lines anywhere below it.
REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")


class APIError(Exception):
    """An error with everything the envelope needs."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.counted = False  # already recorded in gateway_requests_total (with the model's labels)

    def body(self) -> dict[str, Any]:
        err = ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=err).model_dump()

    def named(self, names: Mapping[str, str]) -> APIError:
        """This error with a field named in the neutral (OpenAI chat) terms renamed, in `param` and
        in the message."""
        if self.param is None:
            return self
        head, dot, rest = self.param.partition(".")
        new = names.get(self.param) or (names[head] + dot + rest if head in names else None)
        if new is None:
            return self
        old = self.param if self.param in names else head
        message = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", names.get(old, new), self.message)
        return APIError(self.status, message, self.type, new, self.code, self.headers)


class ClientDisconnected(Exception):
    """The client went away before the response started; nobody is left to answer."""


class ServerShutdown(Exception):
    """The drain time ran out while this request was still running."""


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down and its drain time ran out before this request finished",
                    type="server_error", code="server_shutdown", headers={"Retry-After": "1"})


def outcome_of(err: APIError) -> str:
    """The `outcome` label of gateway_requests_total for an error response."""
    if err.status == 429 or err.code == "server_draining":
        return "rejected"  # refused by admission control: the client should retry later
    if err.code == "internal_error":
        return "error"  # a bug: an exception nobody expected
    return err.code or err.type


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine_error(exc: EngineError) -> APIError:
    if isinstance(exc, ContextLengthExceeded):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, InvalidGenerationRequest):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineOverloaded):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineCrashed):
        return APIError(502, str(exc), type="server_error", code="engine_failed")
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), type="server_error", code="engine_unloaded")
    if isinstance(exc, ModelNotAvailable):
        return APIError(503, str(exc), type="server_error", code="model_not_available")
    if isinstance(exc, ModelTooLarge):
        return APIError(503, str(exc), type="server_error", code="insufficient_memory")
    if isinstance(exc, NoRoom):
        return APIError(503, str(exc), type="server_error", code="insufficient_memory", headers={"Retry-After": "5"})
    if isinstance(exc, ModelLoadError):
        return APIError(503, str(exc), type="server_error", code="model_load_failed")
    return APIError(500, f"engine failure: {exc}", type="server_error", code="engine_error")


def to_api_error(exc: BaseException) -> APIError:
    """Any exception, as the API error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    if isinstance(exc, ClientDisconnected):
        return APIError(499, "client closed the connection", code="client_closed_request")
    if isinstance(exc, Rejected):
        return APIError(429, str(exc), type="rate_limit_error", code=exc.code,
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, (ServerShutdown, GateClosed)):
        return shutdown_error()
    rid = REQUEST_ID.get()
    log.error("unexpected error in request %s", rid, exc_info=exc)
    return APIError(500, f"internal server error (request id {rid})", type="server_error", code="internal_error")


def record(observer: RequestObserver, exc: BaseException) -> APIError:
    """`exc` as the API error the client gets, recorded once as the request's outcome. Raise the
    result (`from exc`): handlers further out then answer with it and neither count nor log again."""
    err = to_api_error(exc)
    observer.finish(outcome_of(err), err.status)
    err.counted = True
    return err


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body"]
    # Pydantic adds the union member it tried (e.g. "str", "list[str]") to the location.
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS or p.startswith("constrained-")))]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "literal"}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return invalid("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid(f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return invalid("request body must be a JSON object", code="invalid_json")
    if first.get("type") == "missing":
        return invalid(f"missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    if first.get("type") == "extra_forbidden":
        return invalid(f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    msg = first.get("msg", "invalid value")
    return invalid(f"invalid value for '{param}': {msg}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    def respond(request: Request, err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
        outcome = outcome_of(err)
        observer = getattr(request.state, "observer", None)
        if observer is not None:
            observer.finish(outcome, err.status)  # once per request: a no-op if already recorded
        elif request.url.path.startswith("/v1/") and not err.counted:
            request.app.state.metrics.count_error(("", "", ""), outcome, err.status)
        status, body = request.app.state.protocols.answer(err, request.url.path)
        if 400 <= err.status < 500 and err.status != 499:  # the client's mistake, said once in the log
            log.info("request %s: %d %s (param %s)", REQUEST_ID.get(), err.status, err.message, err.param)
        return JSONResponse(body, status_code=status, headers={**err.headers, **(headers or {})})

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, to_api_error(exc))

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(request, _validation_error(exc))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return respond(request, APIError(exc.status_code, str(exc.detail), code=code), dict(exc.headers or {}))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(EngineError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # Anything else is caught by gateway.api.guards, outside the app, with the request id.
