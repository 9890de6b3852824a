"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client.

    Args:
        status: HTTP status.
        message: one line naming the problem (and the field, for bad input).
        param: the request field at fault, when there is one.
        code: a short machine-readable code (e.g. ``context_length_exceeded``).
        retry_after: seconds, sent as ``Retry-After`` (429/503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        if request_id:
            headers["x-request-id"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
