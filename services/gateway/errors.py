"""The gateway's errors, in OpenAI's shape: every module that answers a client raises these."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.config import ClusterConfig

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

    def to_json(self, internal_names: Iterable[str] = ()) -> Json:
        """The body a client gets, whatever its status: its message says no internal host, address
        or port, and names none of `internal_names` (the instances and control-plane processes: a
        429 would say "every md instance is full (md-0, md-1)", "md-0 refused: ..."). Which
        instances exist, where, and which one failed is the operator's to know (the log)."""
        message = without_instances(public_message(self.message), internal_names)
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


# What a failure may say about the cluster's insides: URLs, addresses and host:port
_INTERNAL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\b[\w.-]+:\d{2,5}\b", re.I)


def public_message(message: str) -> str:
    """A message as a client sees it: no internal host, address or port (the log keeps the full
    message under the request id)."""
    return _INTERNAL.sub("<internal>", message)


def internal_names(cfg: ClusterConfig) -> list[str]:
    """The names no client is told: the instances, and the gateways and schedulers when several
    run (a lone one's name is only its role's word: `gateway`)."""
    plane = cfg.control_plane
    replicas = [n for n in plane.gateway_names + plane.scheduler_names if n not in ("gateway", "scheduler")]
    return [i.id for i in cfg.instances] + replicas


def without_instances(message: str, names: Iterable[str]) -> str:
    """`message` with each of the cluster's process names, as a whole word, said as `<instance>`."""
    for iid in sorted(names, key=len, reverse=True):  # md-10 before md-1
        message = re.sub(rf"(?<![\w-]){re.escape(iid)}(?![\w-])", "<instance>", message)
    return message


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
