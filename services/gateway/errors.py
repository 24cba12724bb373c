"""The gateway's errors, in OpenAI's shape: every module that answers a client raises these."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

Json = dict[str, Any]


class APIError(Exception):
    """An error for the client, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        counted: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after if retry_after is not None else (1 if status in (429, 503) else None)
        self.counted = counted  # already in the request metrics (an admitted request's failure)

    def to_json(self, instance_ids: Iterable[str] = ()) -> Json:
        """The body a client gets: a 5xx's message says no internal host, address or port; any
        message names none of `instance_ids` (a 429 or 503 would: "every md instance is full
        (md-0, md-1)"). Which instances exist and which one failed is the operator's to know."""
        message = self.message if self.status < 500 else public_message(self.message)
        message = without_instances(message, instance_ids)
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


# What a server-side failure may say about the cluster's insides: URLs, addresses and host:port
_INTERNAL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\b[\w.-]+:\d{2,5}\b", re.I)


def public_message(message: str) -> str:
    """A 5xx message as a client sees it: no internal host, address or port (the log keeps the
    full message under the request id)."""
    return _INTERNAL.sub("<internal>", message)


def without_instances(message: str, instance_ids: Iterable[str]) -> str:
    """`message` with each of the cluster's instance ids, as a whole word, said as `<instance>`."""
    for iid in sorted(instance_ids, key=len, reverse=True):  # md-10 before md-1
        message = re.sub(rf"(?<![\w-]){re.escape(iid)}(?![\w-])", "<instance>", message)
    return message


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
