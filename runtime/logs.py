"""Logging of every node: human-readable text by default, one JSON object a line with
`--log-format json`.

Each request produces exactly one line per node it passed through, from the
`pdserve.request` logger (`log_request`), with its id, role, outcome and phase timings as
fields. In JSON every field is a key; in text they follow the message as `key=value`.
Logs go to stderr: stdout carries only the `listening on` lines the launchers read.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

from pdserve.runtime.options import option

REQUEST_LOGGER = logging.getLogger("pdserve.request")
LOG_FORMATS = ("text", "json")
# Outcomes that are not the node's failure: finish reasons, and a caller that went away.
SUCCESS_OUTCOMES = frozenset({"ok", "stop", "length", "abort", "cancelled"})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 6), "level": record.levelname,
                "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return text


def _text_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


@dataclass
class LogConfig:
    log_format: str = option("text", "log lines on stderr: text, or one JSON object a line",
                             choices=LOG_FORMATS)
    log_level: str = option("INFO", "least severe log level shown",
                            choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def setup_logging(log_format: str = "text", level: str = "INFO") -> None:
    """Send every pdserve log record to stderr in `log_format` ("text" or "json")."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_request(role: str, request_id: str, outcome: str, **fields) -> None:
    """The one line for one request on this node. Timings are seconds (`*_s`)."""
    record = {"request_id": request_id, "role": role, "outcome": outcome}
    record.update({k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()})
    level = logging.INFO if outcome in SUCCESS_OUTCOMES else logging.WARNING
    REQUEST_LOGGER.log(level, "request", extra={"fields": record})
