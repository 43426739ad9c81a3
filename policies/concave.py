"""Goodput curves that are not concave: what a size decision sees past a dip.

Under Pollux's step-time form (`policies/stepfit.py`) a job's goodput is not concave in its
GPUs at a node boundary: on 4-GPU nodes the 5th GPU brings the synchronisation across nodes,
so it adds little or nothing (or costs), while 8 GPUs beat 4. A rule that walks up one GPU
at a time and stops at the first GPU that adds too little stops at the node's edge. These
pure functions read a curve (a job's goodput at consecutive sizes) past such a dip.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def running_max(values: Sequence[float]) -> tuple[float, ...]:
    """Each point's value or the largest before it, whichever is larger: the curve as its
    increments clamped at 0 should read (a GPU that costs goodput counts as adding none,
    and the GPUs after it are counted from the best point before, not from the dip)."""
    out: list[float] = []
    for value in values:
        out.append(value if not out or value > out[-1] else out[-1])
    return tuple(out)


def hull_vertices(values: Sequence[float]) -> tuple[int, ...]:
    """The indices of the upper hull of the points (index, value): the vertices of the least
    concave majorant, first and last point included (none for no points). A point on a
    chord between two others is not a vertex."""
    hull: list[int] = []
    for index, value in enumerate(values):
        # Drop the last vertex while it lies on or under the chord from the one before it.
        while len(hull) >= 2:
            first, last = hull[-2], hull[-1]
            rise = (values[last] - values[first]) * (index - first)
            if rise > (value - values[first]) * (last - first):
                break
            hull.pop()
        hull.append(index)
    return tuple(hull)


def concave_majorant(values: Sequence[float]) -> tuple[float, ...]:
    """The least concave majorant of `values` at 0, 1, ...: the upper hull of the points,
    read at each point. Where the curve is concave it is the curve; across a dip it is the
    chord from the point before the dip to the one past it, so each GPU of the chord adds
    the chord's average gain."""
    hull = hull_vertices(values)
    out: list[float] = []
    for left, right in itertools.pairwise(hull):
        slope = (values[right] - values[left]) / (right - left)
        out.extend(values[left] + slope * (x - left) for x in range(left, right))
    if hull:
        out.append(values[hull[-1]])
    return tuple(out)


def majorant_knee(values: Sequence[float], min_gain: float) -> int:
    """How many points past the first the majorant reaches by GPUs that each add at least
    `min_gain` (its gains do not rise): the knee seen past a dip, at a vertex of the hull,
    so at a point where the majorant is the curve. Where the curve is concave, the knee of
    its own gains."""
    hull = hull_vertices(values)
    reached = 0
    for left, right in itertools.pairwise(hull):
        if values[right] - values[left] < min_gain * (right - left):
            break
        reached = right
    return reached
