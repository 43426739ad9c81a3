"""A job's progress against its expected epochs, its ETA, and the metrics its workers
report: pure functions of the workers' reports.

Apart from the running step that records them because they decide numbers people plan by
(when will it end) and are tested with known answers; the step only stores what they give.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from herd_operator.specs.status import MAX_JOB_METRICS, Progress
from herd_operator.specs.values import Report

ETA_EPOCHS = 5
"""How many of the latest epochs measured at the current world size the ETA is made of."""


def epoch_seconds(reports: Sequence[Report]) -> list[tuple[int, float]]:
    """(world size, seconds) of each epoch measured whole at one world size, oldest first.

    An epoch is measured between two epoch-end reports in a row (no reset report between
    them: a resize, or Horovod's recovery, restarts the epoch) at the same world size,
    whose epochs increase: k epochs between them each took 1/k of the time. Anything else
    (a reset between, a size change, an epoch that went back after a rollback) measures
    nothing. A measurement within an epoch (`Report.measurement`) is neither: it is passed over.
    """
    measured: list[tuple[int, float]] = []
    previous: Report | None = None
    for report in reports:
        if report.measurement:
            continue
        if report.epoch is None:
            previous = None
            continue
        if (
            previous is not None
            and previous.epoch is not None
            and report.world_size == previous.world_size
            and report.epoch > previous.epoch
            and report.time >= previous.time
        ):
            epochs = report.epoch - previous.epoch
            seconds = (report.time - previous.time) / epochs
            measured.extend([(report.world_size, seconds)] * min(epochs, ETA_EPOCHS))
        previous = report
    return measured


def estimate_progress(expected: int, reports: Sequence[Report], last_epoch: int | None) -> Progress:
    """Progress against ``expected`` epochs from the workers' ``reports`` of this launch
    (oldest first) and the last epoch the job reported (``last_epoch``, perhaps of an earlier
    launch; epochs count from 0).

    The ETA: the median of the last `ETA_EPOCHS` epoch times measured at the current world
    size (the last report's) times the epochs left, counted from the last epoch's end. The
    median, so that one slow epoch (a checkpoint, a loaded node) does not move it much; at
    the current size only, since another size trains at another speed. Unknown (None)
    until an epoch has been measured whole at this size: after each resize, until one
    epoch has ended at the new size after a full one at it. Done (completed >= expected):
    the last epoch's end.
    """
    completed = 0 if last_epoch is None else last_epoch + 1
    size = reports[-1].world_size if reports else None
    at_size = [seconds for world, seconds in epoch_seconds(reports) if world == size]
    per_epoch = statistics.median(at_size[-ETA_EPOCHS:]) if at_size else None
    ends = [report.time for report in reports if report.epoch is not None]
    last_end = ends[-1] if ends else None
    completion: float | None = None
    if last_end is not None and completed >= expected:
        completion = last_end
    elif last_end is not None and per_epoch is not None:
        completion = last_end + (expected - completed) * per_epoch
    return Progress(
        epochs=expected,
        completed=completed,
        epoch_seconds=per_epoch,
        world_size=size if per_epoch is not None else None,
        estimated_completion=completion,
    )


def eta_seconds(progress: Progress | None, now: float) -> float | None:
    """Seconds until ``progress``'s estimated completion (0 once it is past; None: unknown)."""
    if progress is None or progress.estimated_completion is None:
        return None
    return max(0.0, progress.estimated_completion - now)


def latest_metrics(
    kept: Mapping[str, float], reports: Sequence[Report], limit: int = MAX_JOB_METRICS
) -> dict[str, float]:
    """The latest value of each metric reported with an epoch end, over what was ``kept``.

    At most ``limit`` names: those already kept, then new ones in the order they were
    first reported while there is room; a name beyond it is not kept (nor shown). So a
    script that reports a new name each epoch holds `limit` series, not one per epoch.
    """
    shown = dict(kept)
    for report in reports:
        if report.epoch is None:
            continue
        for name, value in report.metrics.items():
            if name in shown or len(shown) < limit:
                shown[name] = value
    return shown


def done_fraction(progress: Progress | None) -> float | None:
    """The share of its expected epochs a job has done (`Demand.done_fraction`: a queue that
    orders by work left reads it); None without `training.epochs`."""
    if progress is None or progress.epochs <= 0:
        return None
    return min(1.0, progress.completed / progress.epochs)
