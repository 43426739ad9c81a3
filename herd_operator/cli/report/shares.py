"""The report's shared GPUs: from the store's log of the sharing jobs on each GPU to the
spans when a GPU held several jobs, and the bars the figure draws of them.

Pure (no store, no matplotlib): the text, the JSON, the CSV and the figure all show
these numbers, and the tests check them without drawing.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from herd_operator.policies.sharing_text import format_bytes
from herd_operator.runtime.store import ShareChange

LANE_HEIGHT = 0.8
"""Of one GPU's lane in the figure, the part the fullest shared GPU fills (the rest keeps
lanes apart)."""


def job_memory(job: str, count: int) -> str:
    """``a 2.0Gi``: a job with the memory its worker is counted for (``?``: not known)."""
    return f"{job} {format_bytes(count) if count else '?'}"


@dataclass(frozen=True)
class SharedSpan:
    """GPU ``gpu`` (``host:index``) held these jobs' workers together from ``start`` to
    ``end`` (run seconds), each counted for its bytes per worker (0: not known)."""

    gpu: str
    start: float
    end: float
    jobs: tuple[tuple[str, int], ...]

    def label(self) -> str:
        """``a 2.0Gi, b 512.0Mi``: each job with its counted memory (``?``: not known)."""
        return ", ".join(job_memory(job, count) for job, count in self.jobs)


def shared_spans(
    changes: Sequence[ShareChange],
    origin: float,
    end: float,
    jobs: AbstractSet[str] | None = None,
) -> tuple[SharedSpan, ...]:
    """The spans, within run seconds 0..``end`` (unix ``origin`` is 0), when a GPU held two or
    more jobs, by GPU then time; a GPU's state holds from its change to its next (the last
    to ``end``); changes before ``origin`` only set the state at 0. ``jobs``: only spans
    with one of them (None: all)."""
    by_gpu: dict[str, list[ShareChange]] = {}
    for change in changes:
        by_gpu.setdefault(f"{change.host}:{change.gpu}", []).append(change)
    spans: list[SharedSpan] = []
    for gpu in sorted(by_gpu):
        logged = by_gpu[gpu]
        for change, following in zip(logged, [*logged[1:], None], strict=True):
            start = max(change.time - origin, 0.0)
            stop = end if following is None else min(following.time - origin, end)
            if len(change.jobs) < 2 or stop <= start:  # not shared, or not in the window
                continue
            if jobs is not None and not jobs & {job for job, _ in change.jobs}:
                continue
            spans.append(SharedSpan(gpu, start, stop, change.jobs))
    return tuple(spans)


@dataclass(frozen=True)
class ShareBar:
    """One job's part of a shared GPU's lane for one span: a bar from ``start`` for
    ``width`` run seconds, from ``bottom`` up ``height`` (lane ``lane`` is y ``lane``..
    ``lane + LANE_HEIGHT``)."""

    lane: int
    start: float
    width: float
    bottom: float
    height: float
    job: str
    text: str


def share_bars(spans: Sequence[SharedSpan]) -> tuple[list[str], list[ShareBar]]:
    """The lanes (one per GPU, in the spans' order) and each job's bar in them: its height is
    its counted memory (all its workers' on that GPU: one), to the scale of the span that
    counts most; where no memory is known, each job counts alike."""
    lanes = list(dict.fromkeys(span.gpu for span in spans))
    known = all(count > 0 for span in spans for _, count in span.jobs)

    def amount(count: int) -> float:
        return float(count) if known else 1.0

    fullest = max((sum(amount(count) for _, count in span.jobs) for span in spans), default=1.0)
    bars: list[ShareBar] = []
    for span in spans:
        lane = lanes.index(span.gpu)
        bottom = float(lane)
        for job, count in span.jobs:
            height = LANE_HEIGHT * amount(count) / fullest
            width = span.end - span.start
            bars.append(
                ShareBar(lane, span.start, width, bottom, height, job, job_memory(job, count))
            )
            bottom += height
    return lanes, bars
