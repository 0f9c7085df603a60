"""The server's ASGI middleware, at the door before any route: each request's arrival time and the body limit
(`BodyLimit`), and the API key (`ApiKey`)."""
from __future__ import annotations

import hmac
import time

from .requests import HTTP_TOO_LARGE, HTTP_UNAUTHORIZED, ApiError


class BodyLimit:
    """ASGI middleware at the door: notes each request's arrival (`request.state.arrival`, where TTFT and latency
    are measured from, before its body is read and parsed), and refuses a body beyond `limit` bytes with 413 as it
    arrives (declared by content-length or counted while chunks come)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await ApiError(HTTP_TOO_LARGE, self._message()).response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(HTTP_TOO_LARGE, self._message())
            return message

        return await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body exceeds {self.limit} bytes, more than any prompt that fits the context; shorten it"


class ApiKey:
    """ASGI middleware: every /v1/ route asks for `Authorization: Bearer <key>` and answers 401 in OpenAI's error
    shape without it; the other routes (/health, /ping, /version, /metrics, /tokenize, /detokenize) stay open, as
    vLLM leaves them, and so does a CORS preflight (a browser sends it without the key)."""

    def __init__(self, app, key: str):
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and (path == "/v1" or path.startswith("/v1/")):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = ApiError(HTTP_UNAUTHORIZED, "a valid API key is needed: send the header 'Authorization: "
                                 "Bearer <key>' with the key this server was started with", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)
