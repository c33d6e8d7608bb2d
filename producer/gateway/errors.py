"""Errors a gateway request answers with, in OpenAI's shape: `{"error": {message, type, param, code}}`.

OpenAI's SDKs turn the status into their exception classes (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 413/429 ...) and show `message`, so the message is what a person reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the request shapes (`translate`, `echo`) serve bulk files too, without the gateway extra
    from starlette.responses import JSONResponse


class ApiError(Exception):
    """An answer other than success: HTTP status, OpenAI error type, the offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry = retry

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON answer; `x-should-retry` (which OpenAI's SDKs obey) when `retry` says yes or no."""
        from starlette.responses import JSONResponse

        headers = {} if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, why: str) -> ApiError:
    """A parameter OpenAI defines that mlxq's workers do not implement: refused, never ignored."""
    return ApiError(
        400, f"`{param}` is not supported by mlxq: {why}", param=param, code="unsupported_parameter"
    )
