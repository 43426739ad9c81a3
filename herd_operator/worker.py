"""The worker API for training scripts: `from herd_operator import worker as herd`.

The public face of `herd_operator.agent.worker` (see there for what each call does).
Scripts import this name, so it stays where it is when the internals move.
"""

from __future__ import annotations

from herd_operator.agent.worker import (
    DeviceBinding,
    bind_device,
    report_epoch,
    report_reset,
    under_operator,
)

__all__ = ["DeviceBinding", "bind_device", "report_epoch", "report_reset", "under_operator"]
