"""HTTP policy in front of the routes, as one pure ASGI middleware (no per-chunk wrapping cost
beyond one call): request ids, the Host check against DNS rebinding, CORS, API keys, refusal
while draining, the request-body limit, and the last-resort 500 for anything unexpected.

Every refusal is in the envelope of the protocol the path belongs to, counted in
`gateway_requests_total`.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from gateway.api.adapter import Protocols
from gateway.api.errors import REQUEST_ID, APIError, outcome_of, to_api_error
from gateway.metrics import Metrics

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_LOOPBACK_ORIGIN = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$", re.IGNORECASE)
# Request headers a browser may send cross-origin: what the OpenAI SDK and fetch() use.
_ALLOWED_HEADERS = frozenset({"authorization", "content-type", "accept", "openai-organization", "openai-project",
                              "openai-beta", "x-request-id", "cache-control", "x-api-key", "anthropic-version",
                              "anthropic-beta", "anthropic-dangerous-direct-browser-access"})
_ALLOWED_HEADER_PREFIXES = ("x-stainless-",)
_EXPOSED_HEADERS = "X-Engine, X-Device, X-Fallback-Reason, X-Request-Id, Retry-After"
_METHODS = "GET, POST, OPTIONS"
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def is_loopback_bind(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclass(frozen=True)
class Policy:
    """What the guards enforce; built once from Settings."""

    api_keys: tuple[str, ...] = ()
    metrics_keys: tuple[str, ...] = ()  # when set, /metrics needs one of these
    allowed_origins: tuple[str, ...] = ()  # beyond loopback origins; "*" allows any
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted beyond loopback names
    check_host: bool = True  # refuse unknown Host headers (on when bound to loopback)
    max_body: int = 4 * 1024 * 1024  # bytes
    send_request_id: bool = True  # off behind Ray Serve's proxy, which sends the same x-request-id itself


class Drain:
    """Shared shutdown state: the server sets it, the guards and the streams read it."""

    def __init__(self) -> None:
        self.draining = False  # no new requests
        self.expired = False  # drain time is up: running work is being ended
        self.inflight = 0  # API requests between their first byte in and their last byte out
        self.retry_after = 5

    def begin(self, retry_after: float) -> None:
        self.draining = True
        self.retry_after = max(1, int(retry_after))


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Constant-time in the key's content: every configured key is compared, none skipped."""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented.encode(), k.encode())
    return ok


# OpenAI routes also served without their /v1 prefix (clients given a base URL without it, as
# llama-server allows): the same routes, keys, limits and error envelope.
UNVERSIONED = ("/chat/completions", "/completions", "/embeddings", "/models", "/responses")


def normalized(scope: Scope, protocols: Protocols) -> Scope:
    """The scope as the routes expect it: an unversioned OpenAI alias rewritten to its /v1 path, and
    the body read as JSON whatever its Content-Type says where the protocol does so (Ollama:
    LiteLLM's `ollama_chat` provider sends none)."""
    path: str = scope["path"]
    if any(path == a or path.startswith(a + "/") for a in UNVERSIONED):
        return {**scope, "path": "/v1" + path, "raw_path": b"/v1" + scope.get("raw_path", path.encode())}
    if scope["method"] == "POST" and protocols.for_path(path).json_any_content_type:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
        return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
    return scope


class Guards:
    def __init__(self, app: ASGIApp, policy: Policy, drain: Drain, metrics: Metrics, protocols: Protocols) -> None:
        self.app = app
        self.protocols = protocols
        self.policy = policy
        self.drain = drain
        self.metrics = metrics

    def origin_allowed(self, origin: str, host: str) -> bool:
        allowed = self.policy.allowed_origins
        if _LOOPBACK_ORIGIN.match(origin) or "*" in allowed or origin.rstrip("/") in allowed:
            return True
        # The gateway's own web page, reached by a name the Host check accepted: same-origin. Without
        # the Host check a rebound DNS name would look same-origin too, so it needs --allowed-origins.
        return self.policy.check_host and origin.lower().split("://", 1)[-1].rstrip("/") == host.lower()

    def host_allowed(self, host: str) -> bool:
        if not self.policy.check_host:
            return True
        # The name without its port: "[::1]:8080" -> "[::1]", "localhost:80" -> "localhost".
        name = (host[: host.find("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]).lower()
        return name in LOOPBACK_HOSTS or name in self.policy.allowed_hosts or "*" in self.policy.allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = normalized(scope, self.protocols)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        rid = given if _REQUEST_ID_OK.match(given) else f"req-{uuid.uuid4().hex[:20]}"
        scope.setdefault("state", {})["request_id"] = rid
        token = REQUEST_ID.set(rid)
        try:
            await self._guarded(scope, receive, send, headers, rid)
        finally:
            REQUEST_ID.reset(token)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str], rid: str) -> None:
        path: str = scope["path"]
        origin = headers.get("origin")
        extra: list[tuple[bytes, bytes]] = [(b"x-request-id", rid.encode())] if self.policy.send_request_id else []

        async def refuse(err: APIError, more: list[tuple[bytes, bytes]] | None = None) -> None:
            self.metrics.count_error(("", "", ""), outcome_of(err), err.status)
            await _send_json(send, *self.protocols.answer(err, path), extra + (more or []) + _pairs(err.headers))

        refusal = self._gate(headers)
        if refusal is None and origin is not None:
            extra += [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                      (b"access-control-expose-headers", _EXPOSED_HEADERS.encode())]
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await self._preflight(send, headers, extra, refuse)
                return
        refusal = refusal or self._admit(path, headers)
        if refusal is not None:
            await refuse(*refusal)
            return
        await self._run(scope, receive, send, extra, refuse, rid)

    def _gate(self, headers: dict[str, str]) -> tuple[APIError, list[tuple[bytes, bytes]]] | None:
        """Who may ask at all: the Host header (DNS-rebinding guard) and a browser's origin."""
        host = headers.get("host", "")
        if not self.host_allowed(host):
            return APIError(403, f"Host {host!r} is not allowed (DNS-rebinding guard); add it with --allowed-hosts",
                            type="permission_error", code="host_not_allowed"), []
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            return APIError(403, f"origin {origin!r} is not allowed; add it with --allowed-origins",
                            type="permission_error", code="origin_not_allowed"), []
        return None

    def _admit(self, path: str, headers: dict[str, str]) -> tuple[APIError, list[tuple[bytes, bytes]]] | None:
        """What this request may do: its key, the server not draining, its declared size."""
        api = path.startswith("/v1/")
        # /api/* is the web page's JSON (status, load/unload): the same keys as /v1.
        keyed = api or path.startswith("/api/")
        keys = self.policy.api_keys if keyed else (self.policy.metrics_keys if path == "/metrics" else ())
        # Anthropic's clients send the key as x-api-key; everyone else as a bearer token.
        sent = _bearer(headers.get("authorization", "")) or headers.get("x-api-key", "")
        if keys and not key_matches(sent, keys):
            return (APIError(401, "invalid or missing API key (send Authorization: Bearer <key>, or x-api-key)",
                             type="authentication_error", code="invalid_api_key"),
                    [(b"www-authenticate", b'Bearer realm="llm-gateway"')])
        if api and self.drain.draining:
            return APIError(503, "the server is shutting down; retry on another instance or later",
                            type="server_error", code="server_draining",
                            headers={"Retry-After": str(self.drain.retry_after)}), []
        length = headers.get("content-length")
        limit = self._body_limit(path)
        if length is not None and (not length.isdigit() or int(length) > limit):
            return _too_large(limit), []
        return None

    def _body_limit(self, path: str) -> int:
        # Ollama's blob uploads are model files (gigabytes): their route checks the disk space instead.
        return self.policy.max_body if not path.startswith("/api/blobs/") else 1 << 62

    async def _run(self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[bytes, bytes]],
                   refuse: Callable[..., Awaitable[None]], rid: str) -> None:
        """The app, with the response's extra headers, the body's size counted as it arrives, and
        an error after all (never a bare 500 or a cut socket) in the protocol's envelope."""
        path: str = scope["path"]
        api = path.startswith("/v1/")
        limit = self._body_limit(path)
        started = refused = False
        received = 0

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the body limit already answered; the app's own reply goes nowhere
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        async def counted_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit and not refused:
                    await refuse(_too_large(limit))
                    refused = True
            return {"type": "http.disconnect"} if refused else message

        if api:
            self.drain.inflight += 1
        t0 = time.perf_counter()
        try:
            await self.app(scope, counted_receive, send_with_headers)
        except Exception as exc:  # noqa: BLE001 - the last resort: never a bare 500 or a cut socket
            err = to_api_error(exc)
            if started or refused:
                log.error("request %s failed after its response started (%.1fs in)", rid, time.perf_counter() - t0)
            elif (observer := scope.get("state", {}).get("observer")) is not None:
                observer.finish(outcome_of(err), err.status)
                await _send_json(send, *self.protocols.answer(err, path), extra)
            else:
                await refuse(err)
        finally:
            if api:
                self.drain.inflight -= 1

    async def _preflight(self, send: Send, headers: dict[str, str], extra: list[tuple[bytes, bytes]],
                         refuse: Callable[..., Awaitable[None]]) -> None:
        wanted = [h.strip().lower() for h in headers.get("access-control-request-headers", "").split(",") if h.strip()]
        bad = [h for h in wanted if h not in _ALLOWED_HEADERS and not h.startswith(_ALLOWED_HEADER_PREFIXES)]
        if bad or headers["access-control-request-method"].upper() not in _METHODS:
            what = f"headers {', '.join(bad)}" if bad else f"method {headers['access-control-request-method']}"
            await refuse(APIError(403, f"CORS preflight: {what} not allowed", type="permission_error",
                                  code="cors_not_allowed"))
            return
        allow = [(b"access-control-allow-methods", _METHODS.encode()),
                 (b"access-control-allow-headers", ", ".join(wanted).encode()),
                 (b"access-control-max-age", b"600")]
        await send({"type": "http.response.start", "status": 204, "headers": extra + allow})
        await send({"type": "http.response.body", "body": b""})


def _bearer(value: str) -> str:
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes (--max-body)",
                    code="request_too_large")


def _pairs(headers: dict[str, str] | None) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close") if status == 413 else (b"cache-control", b"no-store"),
                            *headers]})
    await send({"type": "http.response.body", "body": data})
