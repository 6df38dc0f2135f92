"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

import msgspec

from glm53.api.schemas import ErrorBody, ErrorDetail
from glm53.errors import Glm53Error

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
_encoder = msgspec.json.Encoder()


class ApiError(Glm53Error):
    """An error answer: status, message, and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.headers = headers

    def body(self) -> bytes:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return _encoder.encode(ErrorBody(error=detail))


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """A 400 for a body msgspec could not decode; `param` is the path of the bad field."""
    message = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"the body is not valid JSON: {message}", code="invalid_json")
    at, missing = _AT.search(message), _MISSING.search(message)
    path = at.group("path") if at else ""
    if missing:
        path = f"{path}.{missing.group('field')}".lstrip(".")
    return ApiError(400, message, param=path or None, code="invalid_value")
