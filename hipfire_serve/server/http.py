"""Minimal ASGI plumbing: reading bodies with a size limit, sending JSON, errors and SSE; the
HTTP protocol that answers unparseable requests in the same error shape; the access-log filter
that keeps query-string values (keys sent as `?api_key=`) out of the logs."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hipfire_serve.server.protocol import ErrorInfo, ErrorResponse, RequestError

_ENCODER = msgspec.json.Encoder()

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ClientGone(Exception):
    """The client disconnected before the request body was complete."""


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param, code=code)
    return encode(ErrorResponse(error=info))


def header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: dict, receive: Any, limit: int) -> bytes:
    """The request body; RequestError(413) past `limit`, ClientGone on disconnect."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is larger than {limit} bytes", status=413)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body is larger than {limit} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(
    send: Any,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Any,
    status: int,
    message: str,
    param: str | None = None,
    *,
    code: str | None = None,
    retry_after_s: float | None = None,
) -> None:
    extra = []
    if retry_after_s is not None:
        extra.append((b"retry-after", str(max(1, int(retry_after_s + 0.999))).encode()))
    await send_bytes(send, status, error_body(status, message, param, code), extra_headers=extra)


async def start_sse(send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ],
        }
    )


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class JsonErrorHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering a request it cannot parse (a malformed request
    line, a `Content-Length` that is no number) in OpenAI's error shape instead of plain text.
    The parser stops at the fault, so the connection is closed after the reply."""

    def send_400_response(self, msg: str) -> None:
        body = error_body(
            400,
            "malformed HTTP request: the request line or a header (such as Content-Length) "
            "could not be parsed",
        )
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head.extend([name, b": ", value, b"\r\n"])
        head.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode() + b"\r\n",
                b"connection: close\r\n\r\n",
            ]
        )
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def redact_query(path: str) -> str:
    """`path?name=value&...` with every value (and every bare part) replaced by `***`."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    parts = [
        (part.partition("=")[0] + "=***" if "=" in part else "***") if part else ""
        for part in query.split("&")
    ]
    return base + "?" + "&".join(parts)


class _RedactQueryValues(logging.Filter):
    """Rewrites the path of uvicorn's access-log records (`%s - "%s %s HTTP/%s" %d`, the path
    third) with `redact_query`. No route takes query parameters, so the values tell a reader
    nothing, while any of them may be a credential (`?api_key=...`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


_REDACT_QUERY_VALUES = _RedactQueryValues()


def redact_access_log() -> None:
    """Installs the query-value filter on uvicorn's access logger (idempotent). Call it after
    `uvicorn.Config` is built: that configures logging, but keeps the filters of loggers."""
    logging.getLogger("uvicorn.access").addFilter(_REDACT_QUERY_VALUES)
