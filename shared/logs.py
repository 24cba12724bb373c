"""Logging for every PDD process: each line names its process (instance), and each line about a
request names the request id, so one `grep` follows a request across the services.

`PDD_LOG_FORMAT=json` switches a process to JSON lines: {"ts", "level", "instance", "logger",
"msg", ...} plus any fields a call passes in `extra` (the gateway's request line carries its
figures this way).
"""

from __future__ import annotations

import json
import logging
import os
import time

_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, instance: str) -> None:
        super().__init__()
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "instance": self.instance,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(instance: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    if os.environ.get("PDD_LOG_FORMAT", "text").lower() == "json":
        handler.setFormatter(JsonFormatter(instance))
    else:
        fmt = logging.Formatter(f"%(asctime)s {instance} %(levelname)s %(message)s")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
