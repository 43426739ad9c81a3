"""What the commands that run in the foreground until stopped (`run`, `exporter`, `demo`)
share: their log lines on stderr, and a stop event that SIGINT and SIGTERM set.

Apart from the command groups, which each hold one kind of work and share this setup.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logging.getLogger("herd_operator").info("%s received", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop
