"""What the commands that run in the foreground until stopped (`run`, `exporter`, `demo`)
share: their log lines on stderr, and a stop event that SIGINT and SIGTERM set.

Apart from the command groups, which each hold one kind of work and share this setup.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

from herd_operator.runtime.log_format import LOG_FORMATS, LogFormat, log_handler


def log_options(parser: argparse.ArgumentParser) -> None:
    """`--log-level` and `--log-format` of a command that logs until stopped."""
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text (default): '<time> <LEVEL> <logger>: <message>' lines; json: one object per "
        "line with time (RFC 3339, UTC), level, logger, message and the call's fields, for "
        "a log shipper. Times are UTC with milliseconds either way",
    )


def configure_logging(level: str, log_format: LogFormat = "text") -> None:
    """Log lines on stderr, stamped in UTC (herd_operator/runtime/log_format.py)."""
    logging.basicConfig(level=level, handlers=[log_handler(log_format, sys.stderr)])


def stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logging.getLogger("herd_operator").info("%s received", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop
