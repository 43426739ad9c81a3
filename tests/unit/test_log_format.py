"""Log lines (issue 28.4): ISO 8601 UTC times in the operator's and the driver's lines, and
`--log-format json`, one object per line, secrets never in it."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Iterator

import pytest

from herd_operator.runtime.engines.hvd_driver import DRIVER_LOG_FORMAT
from herd_operator.runtime.log_format import (
    LOG_TIME_PATTERN,
    REDACTED,
    JsonFormatter,
    TextFormatter,
    log_handler,
    log_time,
    parse_log_time,
)

T0 = 1_700_000_000.25  # 2023-11-14 22:13:20.250 UTC


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("herd_operator.x", logging.WARNING, __file__, 1, message, args, None)
    made.created = T0
    for name, value in extra.items():
        setattr(made, name, value)
    return made


def test_log_time_is_iso_8601_utc_with_milliseconds() -> None:
    assert log_time(T0) == "2023-11-14T22:13:20.250Z"
    assert log_time(0.0) == "1970-01-01T00:00:00.000Z"
    assert re.fullmatch(LOG_TIME_PATTERN, log_time(T0))


@pytest.mark.parametrize("seconds", [T0, 1010.35, 1_800_000_000.999, 0.001])
def test_parse_log_time_reads_back_the_millisecond(seconds: float) -> None:
    assert parse_log_time(log_time(seconds)) == pytest.approx(seconds, abs=0.0005)


@pytest.mark.parametrize("text", ["1000.500", "2023-11-14 22:13:20.250Z", "2023-11-14T22:13:20Z"])
def test_parse_log_time_refuses_other_stamps(text: str) -> None:
    with pytest.raises(ValueError, match="is not a log time"):
        parse_log_time(text)


def test_text_lines_start_with_the_utc_time() -> None:
    line = TextFormatter().format(record("grant %s: %d GPUs", "a", 2))
    assert line == "2023-11-14T22:13:20.250Z WARNING herd_operator.x: grant a: 2 GPUs"


def test_the_drivers_lines_carry_the_same_time() -> None:
    line = TextFormatter(DRIVER_LOG_FORMAT).format(record("grant seen: %s", {"localhost": 2}))
    assert line == "2023-11-14T22:13:20.250Z herd-driver: grant seen: {'localhost': 2}"


def test_a_json_line_has_time_level_logger_message_and_the_calls_fields() -> None:
    line = JsonFormatter().format(record("grant %s: %d GPUs", "a", 2, job="a", gpus=2))
    assert json.loads(line) == {
        "time": "2023-11-14T22:13:20.250Z",
        "level": "WARNING",
        "logger": "herd_operator.x",
        "message": "grant a: 2 GPUs",
        "job": "a",
        "gpus": 2,
    }
    assert "\n" not in line


def test_a_json_line_redacts_fields_named_as_secrets_and_writes_no_arguments() -> None:
    token = "s3cr3t-0123456789abcdef"
    line = JsonFormatter().format(
        record("agent for %s connected", "nid001", agent_key=token, password=token, token=token)
    )
    shown = json.loads(line)
    assert token not in line
    assert shown["agent_key"] == shown["password"] == shown["token"] == REDACTED
    assert shown["message"] == "agent for nid001 connected"
    assert "args" not in shown and "msg" not in shown


def test_a_json_line_holds_the_traceback_as_one_field() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        made = logging.LogRecord(
            "herd_operator.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    shown = json.loads(JsonFormatter().format(made))
    assert shown["message"] == "failed"
    assert shown["exception"].startswith("Traceback (most recent call last):")
    assert shown["exception"].rstrip().endswith("RuntimeError: boom")


def test_fields_json_cannot_say_are_written_as_text() -> None:
    shown = json.loads(JsonFormatter().format(record("x", hosts=("a", "b"), obj=object())))
    assert shown["hosts"] == ["a", "b"]
    assert shown["obj"].startswith("<object object at")


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    logger = logging.getLogger("herd_operator.test_log_format")
    handler = log_handler("json", stream)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_a_json_handler_writes_one_object_per_line(captured: io.StringIO) -> None:
    logger = logging.getLogger("herd_operator.test_log_format")
    logger.warning("one")
    logger.warning("two\nlines", extra={"job": "b"})
    first, second = (json.loads(line) for line in captured.getvalue().splitlines())
    assert (first["message"], second["message"], second["job"]) == ("one", "two\nlines", "b")
