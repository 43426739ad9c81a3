"""How the operator's processes write their log lines: a time in ISO 8601 UTC with
milliseconds first (`2026-12-02T01:23:45.678Z`), as text or as one JSON object per line.

Apart so that the operator (`run`), the node exporter and the in-process Horovod driver
(whose lines land in a job's log) stamp their lines alike, and the benchmarks that read the
driver's lines back parse the one format (`parse_log_time`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

LOG_TIME_PATTERN = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
"""What `log_time` writes, for a regular expression that reads log lines."""

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

_STANDARD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", (), None)).keys()
) | {"message", "asctime", "taskName"}
"""What every LogRecord has: the rest of a record's attributes are the `extra=` fields a
log call gave, which the JSON lines carry as fields of their own."""

_SECRET_NAME = re.compile(r"(?i)(secret|token|password|passwd|key|credential|auth)")
REDACTED = "<redacted>"


def log_time(seconds: float) -> str:
    """A Unix time as the log lines write it: ISO 8601, UTC, milliseconds."""
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def parse_log_time(text: str) -> float:
    """The Unix time of a `log_time` stamp (ValueError if it is not one)."""
    if not re.fullmatch(LOG_TIME_PATTERN, text):
        raise ValueError(f"{text!r} is not a log time like 2026-12-02T01:23:45.678Z")
    return datetime.strptime(text[:-1], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC).timestamp()


class TextFormatter(logging.Formatter):
    """`<ISO 8601 UTC time> <LEVEL> <logger>: <message>`, or another `fmt` with that time."""

    def __init__(self, fmt: str = TEXT_FORMAT) -> None:
        super().__init__(fmt)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return log_time(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `time` (RFC 3339 UTC), `level`, `logger`, `message`, then
    the fields the log call gave with `extra=` (a field whose name says it holds a secret,
    a key or a token is written as "<redacted>"), and `exception` (its traceback) if any.

    The message is formatted as the text line's is; no argument is written apart from it,
    so a JSON line says nothing the text line would not."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": log_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name in _STANDARD_ATTRIBUTES or name in line:
                continue
            line[name] = REDACTED if _SECRET_NAME.search(name) else _plain(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False)


def _plain(value: object) -> object:
    """A JSON value for an `extra=` field: as is when JSON can say it, else its str()."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple) and all(
        isinstance(item, str | int | float | bool) for item in value
    ):
        return list(value)
    return str(value)


def log_handler(log_format: LogFormat = "text", stream: TextIO | None = None) -> logging.Handler:
    """A handler writing `log_format` lines to `stream` (stderr by default)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    return handler
