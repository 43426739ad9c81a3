"""Arbitration and placement: named scenarios and property-based invariants."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.policies.arbitration import arbitrate
from herd_operator.specs.values import Demand, Grant, HostGpus, Placement, Pool, Slot
from tests.unit import arbitration_reference


def place(*hosts: tuple[str, tuple[int, ...]]) -> Placement:
    return Placement(tuple(hosts))


@dataclass(frozen=True)
class Case:
    pool: Mapping[str, int]
    demands: Sequence[Demand]
    current: Mapping[str, Placement]
    expected: Mapping[str, tuple[HostGpus, str]]
    frozen: frozenset[str] = frozenset()


CASES: dict[str, Case] = {
    "admitted when min fits": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=3, max=4, desired=3)],
        current={},
        expected={"job-a": ((("h0", (0, 1, 2)),), "admitted: min 3 fits")},
    ),
    "admitted with extras up to desired": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=1, max=8, desired=3)],
        current={},
        expected={"job-a": ((("h0", (0, 1, 2)),), "admitted 0 -> 3: min 1 fits, policy wants 3")},
    ),
    "pending with reason": Case(
        pool={"h0": 2},
        demands=[Demand("job-a", min=3, max=4, desired=4)],
        current={},
        expected={"job-a": ((), "pending: needs 3 GPUs, 2 free")},
    ),
    "min-3 job waits while A holds its min": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-a", min=2, max=2, desired=2, arrival=0),
            Demand("job-b", min=3, max=3, desired=3, arrival=1),
        ],
        current={"job-a": place(("h0", (0, 1)))},
        expected={
            "job-a": ((("h0", (0, 1)),), "holding 2: policy wants 2"),
            "job-b": ((), "pending: needs 3 GPUs, 2 free"),
        },
    ),
    "min-3 job admitted once A is gone": Case(
        pool={"h0": 4},
        demands=[Demand("job-b", min=3, max=3, desired=3, arrival=1)],
        current={"job-a": place(("h0", (0, 1))), "job-b": Placement.EMPTY},
        expected={"job-b": ((("h0", (0, 1, 2)),), "admitted: min 3 fits")},
    ),
    "same-priority running job shrinks to admit a pending one": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-a", min=1, max=4, desired=4, arrival=0),
            Demand("job-b", min=3, max=3, desired=3, arrival=1),
        ],
        current={"job-a": place(("h0", (0, 1, 2, 3)))},
        expected={
            "job-a": ((("h0", (0,)),), "shrunk 4 -> 1: admitting job-b (min 3)"),
            "job-b": ((("h0", (1, 2, 3)),), "admitted: min 3 fits"),
        },
    ),
    "higher priority on a full pool shrinks a lower one to its min": Case(
        pool={"h0": 2, "h1": 2},
        demands=[
            Demand("job-low", min=1, max=4, desired=4, priority=0, arrival=0),
            Demand("job-high", min=3, max=4, desired=4, priority=5, arrival=1),
        ],
        current={"job-low": place(("h0", (0, 1)), ("h1", (0, 1)))},
        expected={
            "job-high": ((("h1", (0, 1)), ("h0", (1,))), "admitted: min 3 fits"),
            "job-low": ((("h0", (0,)),), "shrunk 4 -> 1: admitting job-high (min 3)"),
        },
    ),
    "lower priority pending cannot take a higher priority job's extras": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-high", min=1, max=4, desired=4, priority=5, arrival=1),
            Demand("job-low", min=1, max=4, desired=1, priority=0, arrival=0),
        ],
        current={"job-high": place(("h0", (0, 1, 2, 3)))},
        expected={
            "job-high": ((("h0", (0, 1, 2, 3)),), "holding 4: policy wants 4"),
            "job-low": ((), "pending: needs 1 GPU, 0 free"),
        },
    ),
    "head of line blocks smaller later jobs but extras still go out": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-a", min=2, max=4, desired=4, arrival=0),
            Demand("job-big", min=3, max=3, desired=3, arrival=1),
            Demand("job-small", min=1, max=1, desired=1, arrival=2),
            Demand("job-lower", min=1, max=1, desired=1, priority=-1, arrival=0),
        ],
        current={"job-a": place(("h0", (0, 1)))},
        expected={
            "job-a": ((("h0", (0, 1, 2, 3)),), "grown 2 -> 4: policy wants 4"),
            "job-big": ((), "pending: needs 3 GPUs, 2 free"),
            "job-small": ((), "pending: waiting behind job-big (priority 0)"),
            "job-lower": ((), "pending: waiting behind job-big (priority 0)"),
        },
    ),
    "fair share of 5 GPUs between two jobs": Case(
        pool={"h0": 5},
        demands=[
            Demand("job-b", min=1, max=8, desired=8, arrival=1),
            Demand("job-a", min=1, max=8, desired=8, arrival=0),
        ],
        current={},
        expected={
            "job-a": (
                (("h0", (0, 1, 2)),),
                "admitted 0 -> 3: min 1 fits, policy wants 8, no more free",
            ),
            "job-b": (
                (("h0", (3, 4)),),
                "admitted 0 -> 2: min 1 fits, policy wants 8, no more free",
            ),
        },
    ),
    "fair share rebalances a running job towards a newcomer": Case(
        pool={"h0": 5},
        demands=[
            Demand("job-a", min=1, max=8, desired=8, arrival=0),
            Demand("job-b", min=1, max=8, desired=8, arrival=1),
        ],
        current={"job-a": place(("h0", (4, 3, 2, 1, 0)))},
        expected={
            "job-a": ((("h0", (4, 3, 2)),), "shrunk 5 -> 3: admitting job-b (min 1)"),
            "job-b": (
                (("h0", (0, 1)),),
                "admitted 0 -> 2: min 1 fits, policy wants 8, no more free",
            ),
        },
    ),
    "fair share capped by a small desire": Case(
        pool={"h0": 5},
        demands=[
            Demand("job-a", min=1, max=8, desired=1, arrival=0),
            Demand("job-b", min=1, max=8, desired=8, arrival=1),
        ],
        current={},
        expected={
            "job-a": ((("h0", (4,)),), "admitted: min 1 fits"),
            "job-b": (
                (("h0", (0, 1, 2, 3)),),
                "admitted 0 -> 4: min 1 fits, policy wants 8, no more free",
            ),
        },
    ),
    "shrink removes the tail and keeps the other GPUs": Case(
        pool={"h0": 4, "h1": 4},
        demands=[Demand("job-a", min=1, max=8, desired=4)],
        current={"job-a": place(("h0", (2, 0, 3)), ("h1", (1, 0)))},
        expected={
            "job-a": ((("h0", (2, 0, 3)), ("h1", (1,))), "shrunk 5 -> 4: policy wants 4"),
        },
    ),
    "shrink past a whole host": Case(
        pool={"h0": 4, "h1": 4},
        demands=[Demand("job-a", min=1, max=8, desired=2)],
        current={"job-a": place(("h1", (3, 1, 2)), ("h0", (1, 0)))},
        expected={"job-a": ((("h1", (3, 1)),), "shrunk 5 -> 2: policy wants 2")},
    ),
    "max lowered below what the job holds": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=1, max=2, desired=3)],
        current={"job-a": place(("h0", (0, 1, 2)))},
        expected={"job-a": ((("h0", (0, 1)),), "shrunk 3 -> 2: max is 2")},
    ),
    "desired below min is clamped": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=2, max=4, desired=0)],
        current={"job-a": place(("h0", (1, 2)))},
        expected={"job-a": ((("h0", (1, 2)),), "holding 2: policy wants 0, min is 2")},
    ),
    "grow keeps existing GPUs and prefers the same host": Case(
        pool={"h0": 4, "h1": 4},
        demands=[Demand("job-a", min=1, max=8, desired=3)],
        current={"job-a": place(("h1", (2,)))},
        expected={"job-a": ((("h1", (2, 0, 1)),), "grown 1 -> 3: policy wants 3")},
    ),
    "grow fills its own host then best-fits the rest": Case(
        pool={"h0": 4, "h1": 4, "h2": 4},
        demands=[
            Demand("job-a", min=1, max=8, desired=5, arrival=0),
            Demand("job-b", min=2, max=2, desired=2, arrival=1),
            Demand("job-c", min=1, max=1, desired=1, arrival=2),
        ],
        current={
            "job-a": place(("h1", (2,))),
            "job-b": place(("h1", (0, 1))),
            "job-c": place(("h2", (0,))),
        },
        expected={
            "job-a": ((("h1", (2, 3)), ("h2", (1, 2, 3))), "grown 1 -> 5: policy wants 5"),
            "job-b": ((("h1", (0, 1)),), "holding 2: policy wants 2"),
            "job-c": ((("h2", (0,)),), "holding 1: policy wants 1"),
        },
    ),
    "best fit picks the fullest host that still holds the job": Case(
        pool={"h0": 4, "h1": 4, "h2": 4},
        demands=[
            Demand("job-x", min=2, max=2, desired=2, arrival=0),
            Demand("job-y", min=1, max=1, desired=1, arrival=1),
            Demand("job-new", min=3, max=3, desired=3, arrival=2),
        ],
        current={"job-x": place(("h0", (0, 1))), "job-y": place(("h1", (0,)))},
        expected={
            "job-x": ((("h0", (0, 1)),), "holding 2: policy wants 2"),
            "job-y": ((("h1", (0,)),), "holding 1: policy wants 1"),
            "job-new": ((("h1", (1, 2, 3)),), "admitted: min 3 fits"),
        },
    ),
    "best fit spills to the host with the most free GPUs": Case(
        pool={"h0": 4, "h1": 4, "h2": 4},
        demands=[
            Demand("job-x", min=2, max=2, desired=2, arrival=0),
            Demand("job-y", min=1, max=1, desired=1, arrival=1),
            Demand("job-new", min=6, max=6, desired=6, arrival=2),
        ],
        current={"job-x": place(("h0", (0, 1))), "job-y": place(("h1", (0,)))},
        expected={
            "job-x": ((("h0", (0, 1)),), "holding 2: policy wants 2"),
            "job-y": ((("h1", (0,)),), "holding 1: policy wants 1"),
            "job-new": ((("h2", (0, 1, 2, 3)), ("h0", (2, 3))), "admitted: min 6 fits"),
        },
    ),
    "larger new jobs are packed first so none is split": Case(
        pool={"h0": 5, "h1": 4},
        demands=[
            Demand("job-a", min=3, max=3, desired=3, arrival=0),
            Demand("job-b", min=4, max=4, desired=4, arrival=1),
            Demand("job-c", min=2, max=2, desired=2, arrival=2),
        ],
        current={},
        expected={
            "job-a": ((("h0", (0, 1, 2)),), "admitted: min 3 fits"),
            "job-b": ((("h1", (0, 1, 2, 3)),), "admitted: min 4 fits"),
            "job-c": ((("h0", (3, 4)),), "admitted: min 2 fits"),
        },
    ),
    "a host leaves and the job regrows elsewhere": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=2, max=4, desired=4)],
        current={"job-a": place(("h1", (0, 1)), ("h0", (3, 2)))},
        expected={
            "job-a": (
                (("h0", (3, 2, 0, 1)),),
                "holding 4: 2 GPUs left the pool, replaced; policy wants 4",
            ),
        },
    ),
    "a host leaves and the job shrinks with it": Case(
        pool={"h0": 2},
        demands=[Demand("job-a", min=2, max=4, desired=4)],
        current={"job-a": place(("h0", (0, 1)), ("h1", (0, 1)))},
        expected={"job-a": ((("h0", (0, 1)),), "shrunk 4 -> 2: 2 GPUs left the pool")},
    ),
    "a host leaves and the job falls under its min": Case(
        pool={"h0": 2},
        demands=[Demand("job-a", min=3, max=4, desired=4)],
        current={"job-a": place(("h0", (0, 1)), ("h1", (0, 1)))},
        expected={
            "job-a": (
                (),
                "pending 4 -> 0: 2 GPUs left the pool (2 left, min 3); needs 3 GPUs, 2 free",
            ),
        },
    ),
    "a host leaves and the job is re-admitted keeping its survivors": Case(
        pool={"h0": 4, "h2": 4},
        demands=[Demand("job-a", min=3, max=3, desired=3)],
        current={"job-a": place(("h1", (0, 1)), ("h0", (2,)))},
        expected={
            "job-a": (
                (("h0", (2, 0, 1)),),
                "re-admitted 3 -> 3: 2 GPUs left the pool (1 left, min 3); min 3 fits",
            ),
        },
    ),
    "a raised min above what the job holds makes it pending": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-a", min=2, max=2, desired=2, arrival=0),
            Demand("job-b", min=3, max=3, desired=3, arrival=1),
        ],
        current={"job-a": place(("h0", (0, 1))), "job-b": place(("h0", (2,)))},
        expected={
            "job-a": ((("h0", (0, 1)),), "holding 2: policy wants 2"),
            "job-b": ((), "pending 1 -> 0: holds 1, under min 3; needs 3 GPUs, 2 free"),
        },
    ),
    "dropped jobs free their GPUs": Case(
        pool={"h0": 2},
        demands=[Demand("job-b", min=2, max=2, desired=2)],
        current={"job-gone": place(("h0", (0, 1)))},
        expected={"job-b": ((("h0", (0, 1)),), "admitted: min 2 fits")},
    ),
    "higher priority extras shrink a lower one": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-low", min=1, max=4, desired=4, priority=0),
            Demand("job-high", min=1, max=4, desired=3, priority=1),
        ],
        current={"job-low": place(("h0", (0, 1, 2))), "job-high": place(("h0", (3,)))},
        expected={
            "job-high": ((("h0", (3, 1, 2)),), "grown 1 -> 3: policy wants 3"),
            "job-low": ((("h0", (0,)),), "shrunk 3 -> 1: job-high (priority 1) grew"),
        },
    ),
}


FROZEN_CASES: dict[str, Case] = {
    "frozen job does not grow into idle GPUs": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=1, max=4, desired=4)],
        current={"job-a": place(("h0", (2, 0)))},
        frozen=frozenset({"job-a"}),
        expected={"job-a": ((("h0", (2, 0)),), "holding 2: resized recently")},
    ),
    "frozen job does not shrink when its desire drops": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=1, max=4, desired=1)],
        current={"job-a": place(("h0", (0, 1, 2)))},
        frozen=frozenset({"job-a"}),
        expected={"job-a": ((("h0", (0, 1, 2)),), "holding 3: resized recently")},
    ),
    "frozen job is not rebalanced towards a newcomer": Case(
        pool={"h0": 6},
        demands=[
            Demand("job-a", min=1, max=8, desired=8, arrival=0),
            Demand("job-b", min=1, max=8, desired=8, arrival=1),
        ],
        current={"job-a": place(("h0", (0, 1, 2, 3)))},
        frozen=frozenset({"job-a"}),
        expected={
            "job-a": ((("h0", (0, 1, 2, 3)),), "holding 4: resized recently"),
            "job-b": (
                (("h0", (4, 5)),),
                "admitted 0 -> 2: min 1 fits, policy wants 8, no more free",
            ),
        },
    ),
    "frozen job is not shrunk to admit a pending job": Case(
        pool={"h0": 5},
        demands=[
            Demand("job-a", min=1, max=4, desired=4, arrival=0),
            Demand("job-b", min=3, max=3, desired=3, arrival=1),
        ],
        current={"job-a": place(("h0", (0, 1, 2, 3)))},
        frozen=frozenset({"job-a"}),
        expected={
            "job-a": ((("h0", (0, 1, 2, 3)),), "holding 4: resized recently"),
            "job-b": ((), "pending: needs 3 GPUs, 1 free (job-a resized recently)"),
        },
    ),
    "frozen lower priority job is not shrunk for a higher one": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-low", min=1, max=4, desired=4, priority=0, arrival=0),
            Demand("job-high", min=3, max=4, desired=4, priority=5, arrival=1),
        ],
        current={"job-low": place(("h0", (0, 1, 2, 3)))},
        frozen=frozenset({"job-low"}),
        expected={
            "job-high": ((), "pending: needs 3 GPUs, 0 free (job-low resized recently)"),
            "job-low": ((("h0", (0, 1, 2, 3)),), "holding 4: resized recently"),
        },
    ),
    "frozen higher priority job above its desire blocks a lower one": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-high", min=1, max=4, desired=1, priority=5, arrival=0),
            Demand("job-low", min=2, max=2, desired=2, priority=0, arrival=1),
        ],
        current={"job-high": place(("h0", (0, 1, 2, 3)))},
        frozen=frozenset({"job-high"}),
        expected={
            "job-high": ((("h0", (0, 1, 2, 3)),), "holding 4: resized recently"),
            "job-low": ((), "pending: needs 2 GPUs, 0 free (job-high resized recently)"),
        },
    ),
    "frozen higher priority job within its desire is not blamed": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-high", min=1, max=4, desired=4, priority=5, arrival=0),
            Demand("job-low", min=2, max=2, desired=2, priority=0, arrival=1),
        ],
        current={"job-high": place(("h0", (0, 1, 2, 3)))},
        frozen=frozenset({"job-high"}),
        expected={
            "job-high": ((("h0", (0, 1, 2, 3)),), "holding 4: resized recently"),
            "job-low": ((), "pending: needs 2 GPUs, 0 free"),
        },
    ),
    "frozen job at its min is not blamed for a job that would not fit anyway": Case(
        pool={"h0": 4},
        demands=[
            Demand("job-a", min=2, max=4, desired=4, arrival=0),
            Demand("job-b", min=3, max=3, desired=3, arrival=1),
        ],
        current={"job-a": place(("h0", (0, 1)))},
        frozen=frozenset({"job-a"}),
        expected={
            "job-a": ((("h0", (0, 1)),), "holding 2: resized recently"),
            "job-b": ((), "pending: needs 3 GPUs, 2 free"),
        },
    ),
    "frozen extras too few to matter are not blamed": Case(
        pool={"h0": 6},
        demands=[
            Demand("job-a", min=1, max=4, desired=4, arrival=0),
            Demand("job-b", min=6, max=6, desired=6, arrival=1),
        ],
        current={"job-a": place(("h0", (0, 1, 2)))},
        frozen=frozenset({"job-a"}),
        expected={
            "job-a": ((("h0", (0, 1, 2)),), "holding 3: resized recently"),
            "job-b": ((), "pending: needs 6 GPUs, 3 free"),
        },
    ),
    "many frozen jobs are named up to three": Case(
        pool={"h0": 10},
        demands=[
            *(Demand(f"job-{n}", min=1, max=2, desired=2, arrival=n) for n in range(5)),
            Demand("job-big", min=5, max=5, desired=5, arrival=9),
        ],
        current={f"job-{n}": place(("h0", (2 * n, 2 * n + 1))) for n in range(5)},
        frozen=frozenset(f"job-{n}" for n in range(5)),
        expected={
            **{
                f"job-{n}": ((("h0", (2 * n, 2 * n + 1)),), "holding 2: resized recently")
                for n in range(5)
            },
            "job-big": (
                (),
                "pending: needs 5 GPUs, 0 free (job-0, job-1, job-2 and 2 more resized recently)",
            ),
        },
    ),
    "frozen job drops GPUs that left the pool without replacing them": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=1, max=4, desired=4)],
        current={"job-a": place(("h1", (0, 1)), ("h0", (3, 2)))},
        frozen=frozenset({"job-a"}),
        expected={"job-a": ((("h0", (3, 2)),), "shrunk 4 -> 2: 2 GPUs left the pool")},
    ),
    "frozen job under its min after a host left is pending as usual": Case(
        pool={"h0": 2},
        demands=[Demand("job-a", min=3, max=4, desired=4)],
        current={"job-a": place(("h0", (0, 1)), ("h1", (0, 1)))},
        frozen=frozenset({"job-a"}),
        expected={
            "job-a": (
                (),
                "pending 4 -> 0: 2 GPUs left the pool (2 left, min 3); needs 3 GPUs, 2 free",
            ),
        },
    ),
    "frozen job under its min after a host left is re-admitted as usual": Case(
        pool={"h0": 4, "h2": 4},
        demands=[Demand("job-a", min=3, max=3, desired=3)],
        current={"job-a": place(("h1", (0, 1)), ("h0", (2,)))},
        frozen=frozenset({"job-a"}),
        expected={
            "job-a": (
                (("h0", (2, 0, 1)),),
                "re-admitted 3 -> 3: 2 GPUs left the pool (1 left, min 3); min 3 fits",
            ),
        },
    ),
    "frozen job above a lowered max shrinks to max, not to its desire": Case(
        pool={"h0": 4, "h1": 4},
        demands=[Demand("job-a", min=1, max=2, desired=1)],
        current={"job-a": place(("h1", (3,)), ("h0", (1, 2)))},
        frozen=frozenset({"job-a"}),
        expected={"job-a": ((("h1", (3,)), ("h0", (1,))), "shrunk 3 -> 2: max is 2")},
    ),
    "frozen job losing a host and above its max gives both causes": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=1, max=2, desired=2)],
        current={"job-a": place(("h0", (0, 1, 2)), ("h1", (0,)))},
        frozen=frozenset({"job-a"}),
        expected={"job-a": ((("h0", (0, 1)),), "shrunk 4 -> 2: 1 GPU left the pool; max is 2")},
    ),
    "frozen pending job is admitted with extras": Case(
        pool={"h0": 4},
        demands=[Demand("job-a", min=1, max=4, desired=3)],
        current={},
        frozen=frozenset({"job-a"}),
        expected={"job-a": ((("h0", (0, 1, 2)),), "admitted 0 -> 3: min 1 fits, policy wants 3")},
    ),
    "frozen names without a demand are ignored": Case(
        pool={"h0": 2},
        demands=[Demand("job-b", min=2, max=2, desired=2)],
        current={"job-gone": place(("h0", (0, 1)))},
        frozen=frozenset({"job-gone", "job-never"}),
        expected={"job-b": ((("h0", (0, 1)),), "admitted: min 2 fits")},
    ),
    "the others share what a frozen job leaves": Case(
        pool={"h0": 4, "h1": 4},
        demands=[
            Demand("job-a", min=1, max=8, desired=8, arrival=0),
            Demand("job-b", min=1, max=8, desired=8, arrival=1),
            Demand("job-c", min=1, max=8, desired=8, arrival=2),
        ],
        current={
            "job-a": place(("h0", (0, 1))),
            "job-b": place(("h0", (2, 3)), ("h1", (0, 1, 2, 3))),
        },
        frozen=frozenset({"job-a"}),
        expected={
            "job-a": ((("h0", (0, 1)),), "holding 2: resized recently"),
            "job-b": (
                (("h0", (2, 3)), ("h1", (0,))),
                "shrunk 6 -> 3: admitting job-c (min 1)",
            ),
            "job-c": (
                (("h1", (1, 2, 3)),),
                "admitted 0 -> 3: min 1 fits, policy wants 8, no more free",
            ),
        },
    ),
}


@pytest.mark.parametrize(
    "case", [*CASES.values(), *FROZEN_CASES.values()], ids=[*CASES, *FROZEN_CASES]
)
def test_scenario(case: Case) -> None:
    pool = Pool.from_counts(case.pool)
    grants = arbitrate(pool, case.demands, case.current, frozen=case.frozen)
    got = {name: (grant.placement.hosts, grant.reason) for name, grant in grants.items()}
    assert got == dict(case.expected)


def test_grants_come_in_priority_then_arrival_order() -> None:
    demands = [
        Demand("job-c", min=1, max=1, desired=1, priority=0, arrival=1),
        Demand("job-b", min=1, max=1, desired=1, priority=0, arrival=1),
        Demand("job-a", min=1, max=1, desired=1, priority=0, arrival=2),
        Demand("job-z", min=1, max=1, desired=1, priority=3, arrival=9),
    ]
    grants = arbitrate(Pool.from_counts({"h0": 8}), demands, {})
    assert list(grants) == ["job-z", "job-b", "job-c", "job-a"]


def test_two_demands_with_one_name_are_refused() -> None:
    demand = Demand("job-a", min=1, max=1, desired=1)
    with pytest.raises(ValueError, match=r"^two demands are named job-a$"):
        arbitrate(Pool.from_counts({"h0": 2}), [demand, demand], {})


def test_overlapping_current_placements_are_refused() -> None:
    demands = [Demand("job-a", 1, 2, 2), Demand("job-b", 1, 2, 2)]
    current = {"job-b": place(("h0", (1,))), "job-a": place(("h0", (0, 1)))}
    with pytest.raises(
        ValueError, match=r"^GPU h0:1 is in the current placements of both job-a and job-b$"
    ):
        arbitrate(Pool.from_counts({"h0": 2}), demands, current)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "", "min": 1, "max": 1}, "demand: name must not be empty"),
        ({"name": "j", "min": 0, "max": 1}, "demand j: need 1 <= min <= max, got min 0 max 1"),
        ({"name": "j", "min": 3, "max": 2}, "demand j: need 1 <= min <= max, got min 3 max 2"),
        (
            {"name": "j", "min": 1, "max": 1, "arrival": float("nan")},
            "demand j: arrival must be finite, got nan",
        ),
    ],
)
def test_invalid_demands_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        Demand(desired=1, **kwargs)  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_invalid_pools_and_placements_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^pool: host 'h0' is listed twice$"):
        Pool((("h0", (0,)), ("h0", (1,))))
    with pytest.raises(ValueError, match=r"^placement: host 'h0' lists a GPU twice: \[1, 1\]$"):
        place(("h0", (1, 1)))
    with pytest.raises(ValueError, match=r"^pool: host 'h0' has a negative GPU count: -1$"):
        Pool.from_counts({"h0": -1})
    with pytest.raises(ValueError, match=r"^placement: host 'h0' has a negative GPU index"):
        place(("h0", (-1,)))


def test_pool_basics() -> None:
    pool = Pool.from_counts({"b": 2, "a": 1})
    assert pool.hosts == (("b", (0, 1)), ("a", (0,)))
    assert pool.size == 3
    assert pool.slots() == (("b", 0), ("b", 1), ("a", 0))
    assert hash(pool) == hash(Pool.from_counts({"b": 2, "a": 1}))


def test_placement_basics() -> None:
    placement = place(("n2", (3, 1)), ("n1", ()), ("n0", (0,)))
    assert placement.size == 3
    assert placement.slots() == (("n2", 3), ("n2", 1), ("n0", 0))
    assert placement.gpus_on("n2") == (3, 1)
    assert placement.gpus_on("missing") == ()
    assert Placement.EMPTY.size == 0
    assert not Grant(Placement.EMPTY, "pending").admitted
    assert Grant(placement, "holding 3").admitted


def test_placement_json_round_trip() -> None:
    placement = place(("n2", (3, 1)), ("n0", (0,)))
    assert placement.to_json() == [["n2", [3, 1]], ["n0", [0]]]
    assert Placement.from_json(placement.to_json()) == placement
    assert Placement.from_json([]) == Placement.EMPTY


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"n0": [0]}, "placement: expected a list of [host, [gpus]], got {'n0': [0]}"),
        ([["n0"]], "placement: expected [host, [gpus]], got ['n0']"),
        ([[0, [0]]], "placement: expected [host, [gpus]], got [0, [0]]"),
        ([["n0", [True]]], "placement: GPU indices must be integers, got ['n0', [True]]"),
        ([["n0", [0, 0]]], "placement: host 'n0' lists a GPU twice: [0, 0]"),
    ],
)
def test_placement_from_bad_json_is_refused(data: object, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        Placement.from_json(data)
    assert str(raised.value) == message


# Property-based tests: random pools, jobs and sequences of decisions.


def free_slots(pool: Pool, placements: Mapping[str, Placement]) -> tuple[Slot, ...]:
    """Slots of `pool` in no placement, in pool order."""
    taken = {slot for placement in placements.values() for slot in placement.slots()}
    return tuple(slot for slot in pool.slots() if slot not in taken)


@dataclass(frozen=True)
class Job:
    name: str
    min: int
    max: int
    priority: int
    arrival: int


@dataclass(frozen=True)
class Step:
    present: tuple[bool, ...]
    desired: tuple[int, ...]
    max_cut: tuple[int, ...]
    hosts_up: tuple[bool, ...]
    frozen: tuple[bool, ...]


@dataclass(frozen=True)
class Story:
    counts: tuple[int, ...]
    jobs: tuple[Job, ...]
    steps: tuple[Step, ...]


@st.composite
def stories(draw: st.DrawFn) -> Story:
    counts = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=6)))
    jobs = []
    for index in range(draw(st.integers(1, 8))):
        low = draw(st.integers(1, 6))
        jobs.append(
            Job(
                name=f"job-{index}",
                min=low,
                max=draw(st.integers(low, low + 6)),
                priority=draw(st.integers(0, 2)),
                arrival=draw(st.integers(0, 4)),
            )
        )
    steps = draw(
        st.lists(
            st.builds(
                Step,
                present=st.tuples(*(st.booleans() for _ in jobs)),
                desired=st.tuples(*(st.integers(0, 14) for _ in jobs)),
                # A user sometimes lowers max for a while.
                max_cut=st.tuples(*(st.sampled_from([0, 0, 0, 1, 3]) for _ in jobs)),
                # Hosts mostly stay; sometimes one leaves (and may come back later).
                hosts_up=st.tuples(
                    *(st.sampled_from([True, True, True, True, False]) for _ in counts)
                ),
                # Drawn for every job: absent and pending ones must be unaffected.
                frozen=st.tuples(*(st.booleans() for _ in jobs)),
            ),
            min_size=1,
            max_size=6,
        )
    )
    return Story(counts, tuple(jobs), tuple(steps))


def pool_at(story: Story, step: Step) -> Pool:
    return Pool.from_counts(
        {
            f"h{i}": count
            for i, (count, up) in enumerate(zip(story.counts, step.hosts_up, strict=True))
            if up
        }
    )


def demands_at(story: Story, step: Step) -> list[Demand]:
    return [
        Demand(
            job.name,
            job.min,
            max(job.min, job.max - cut),
            desired,
            job.priority,
            float(job.arrival),
        )
        for job, present, desired, cut in zip(
            story.jobs, step.present, step.desired, step.max_cut, strict=True
        )
        if present
    ]


def frozen_at(story: Story, step: Step) -> frozenset[str]:
    return frozenset(
        job.name for job, frozen in zip(story.jobs, step.frozen, strict=True) if frozen
    )


def rank(demand: Demand) -> tuple[int, float, str]:
    return (-demand.priority, demand.arrival, demand.name)


def check_decision(
    pool: Pool,
    demands: Sequence[Demand],
    current: Mapping[str, Placement],
    grants: Mapping[str, Grant],
    frozen: frozenset[str] = frozenset(),
) -> None:
    by_name = {d.name: d for d in demands}
    assert set(grants) == set(by_name)
    in_pool = set(pool.slots())
    # Frozen and still running on at least its min of surviving GPUs: it must hold still.
    held = {
        name: [slot for slot in current[name].slots() if slot in in_pool]
        for name in frozen & set(by_name) & set(current)
    }
    held = {name: slots for name, slots in held.items() if len(slots) >= by_name[name].min}
    owners: dict[tuple[str, int], str] = {}
    for name, grant in grants.items():
        demand = by_name[name]
        size = grant.placement.size
        for slot in grant.placement.slots():
            assert slot in in_pool, f"{name} got {slot} outside the pool"
            assert owners.setdefault(slot, name) == name, f"{slot} in {owners[slot]} and {name}"
        if name in held:
            # Unchanged but for GPUs that left the pool and a max below its size (tail first).
            expected = tuple(held[name][: demand.max])
            assert grant.placement.slots() == expected, f"frozen {name} moved"
            before_size = current[name].size
            lost = before_size - len(held[name])
            causes = [f"{lost} GPU{'s' if lost > 1 else ''} left the pool"] if lost else []
            if len(held[name]) > demand.max:
                causes.append(f"max is {demand.max}")
            assert grant.reason == (
                f"shrunk {before_size} -> {size}: {'; '.join(causes)}"
                if causes
                else f"holding {size}: resized recently"
            )
        else:
            assert size == 0 or demand.min <= size <= demand.wanted <= demand.max
        assert grant.reason.startswith("pending") == (size == 0), grant.reason
        assert all(gpus for _, gpus in grant.placement.hosts), "empty host in a placement"

    idle = pool.size - len(owners)
    if idle:
        for name, grant in grants.items():
            if grant.admitted and name not in held:
                assert grant.placement.size == by_name[name].wanted, f"{name} wants more"
    pending = sorted((d for d in demands if not grants[d.name].admitted), key=rank)
    if pending:
        head = pending[0]
        # Idle GPUs and unfrozen extras that do not outrank the head: it could claim them all.
        claimable = idle + sum(
            grants[d.name].placement.size - d.min
            for d in demands
            if grants[d.name].admitted and d.name not in held and d.priority <= head.priority
        )
        assert head.min > claimable, f"{head.name} is pending with {claimable} claimable"
        # Head of line: nobody overtakes a pending job to get admitted.
        for demand in demands:
            held_before = current.get(demand.name, Placement.EMPTY).size
            if grants[demand.name].admitted and held_before < demand.min:
                assert rank(demand) < rank(pending[0]), f"{demand.name} jumped the queue"
    idle_hosts = {host for host, _ in free_slots(pool, {n: g.placement for n, g in grants.items()})}

    for name, grant in grants.items():
        before = current.get(name, Placement.EMPTY)
        demand = by_name[name]
        stayed = all(slot in in_pool for slot in before.slots())
        if before.size >= demand.min and stayed:
            assert grant.placement.size >= demand.min, f"{name} was taken below its min"
        kept_count = sum(1 for slot in before.slots() if slot in in_pool)
        if stayed and grant.admitted and grant.placement.size < min(before.size, demand.wanted):
            # Someone of the same or higher priority must have gained what it lost.
            gainers = [
                other
                for other in demands
                if other.name != name
                and other.priority >= demand.priority
                and grants[other.name].placement.size
                > sum(
                    1
                    for slot in current.get(other.name, Placement.EMPTY).slots()
                    if slot in in_pool
                )
            ]
            assert gainers, f"{name} shrank {before.size} -> {grant.placement.size} for nobody"
        new_hosts = {host for host, _ in grant.placement.hosts} - {host for host, _ in before.hosts}
        if new_hosts:
            # A grower fills the hosts it already uses before it spreads to others.
            assert not idle_hosts & {host for host, _ in before.hosts}, f"{name} spread early"
        for host, old_gpus in before.hosts:
            survivors = [gpu for gpu in old_gpus if (host, gpu) in in_pool]
            new_gpus = grant.placement.gpus_on(host)
            common = [gpu for gpu in new_gpus if gpu in survivors]
            # Surviving workers keep their GPU: what is kept is a prefix, at the same ranks.
            assert common == survivors[: len(common)], f"{name} on {host}: {old_gpus}->{new_gpus}"
            assert list(new_gpus[: len(common)]) == common
        if grant.admitted and kept_count >= demand.min:
            kept_total = sum(1 for slot in grant.placement.slots() if slot in set(before.slots()))
            assert kept_total == min(kept_count, grant.placement.size), f"{name} moved GPUs"


@settings(max_examples=200, deadline=None)
@given(story=stories(), seed=st.integers(0, 2**32 - 1))
def test_decision_sequences_keep_every_rule(story: Story, seed: int) -> None:
    shuffler = random.Random(seed)
    current: dict[str, Placement] = {}
    for step in story.steps:
        pool = pool_at(story, step)
        demands = demands_at(story, step)
        frozen = frozen_at(story, step)
        grants = arbitrate(pool, demands, current, frozen=frozen)
        check_decision(pool, demands, current, grants, frozen)

        shuffled_demands = demands[:]
        shuffler.shuffle(shuffled_demands)
        names = list(current)
        shuffler.shuffle(names)
        again = arbitrate(
            pool, shuffled_demands, {name: current[name] for name in names}, frozen=set(frozen)
        )
        assert list(again.items()) == list(grants.items())

        current = {name: grant.placement for name, grant in grants.items() if grant.admitted}


@settings(max_examples=100, deadline=None)
@given(story=stories())
def test_a_repeated_decision_changes_nothing(story: Story) -> None:
    step = story.steps[0]
    pool = pool_at(story, step)
    demands = demands_at(story, step)
    first = arbitrate(pool, demands, {})
    current = {name: grant.placement for name, grant in first.items() if grant.admitted}
    second = arbitrate(pool, demands, current)
    assert {n: g.placement for n, g in second.items()} == {n: g.placement for n, g in first.items()}
    for name, grant in second.items():
        assert grant.reason.startswith(("holding", "pending:")), (name, grant.reason)


@settings(max_examples=100, deadline=None)
@given(story=stories())
def test_freezing_every_admitted_job_changes_nothing(story: Story) -> None:
    step = story.steps[0]
    pool = pool_at(story, step)
    demands = demands_at(story, step)
    first = arbitrate(pool, demands, {})
    current = {name: grant.placement for name, grant in first.items() if grant.admitted}
    # Desires move, yet frozen jobs hold still and pending ones stay pending.
    moved = [
        Demand(d.name, d.min, d.max, d.max - d.desired % 3, d.priority, d.arrival) for d in demands
    ]
    second = arbitrate(pool, moved, current, frozen=frozenset(current))
    for name, grant in second.items():
        assert grant.placement == first[name].placement
        if grant.admitted:
            assert grant.reason == f"holding {grant.placement.size}: resized recently"


def without(pool: Pool, gone: set[Slot]) -> Pool:
    hosts = (
        (host, tuple(gpu for gpu in gpus if (host, gpu) not in gone)) for host, gpus in pool.hosts
    )
    return Pool(tuple((host, gpus) for host, gpus in hosts if gpus))


@settings(max_examples=100, deadline=None)
@given(story=stories(), seed=st.integers(0, 2**32 - 1))
def test_unavailable_gpus_decide_as_a_pool_without_them(story: Story, seed: int) -> None:
    # The allocator passes draining and held GPUs as `unavailable` instead of building a
    # smaller pool for each decision: the grants must be the same, reasons included.
    chooser = random.Random(seed)
    current: dict[str, Placement] = {}
    for step in story.steps:
        pool = pool_at(story, step)
        demands = demands_at(story, step)
        frozen = frozen_at(story, step)
        slots = list(pool.slots())
        gone = set(chooser.sample(slots, chooser.randint(0, len(slots))))
        grants = arbitrate(pool, demands, current, frozen=frozen, unavailable=gone)
        assert grants == arbitrate(without(pool, gone), demands, current, frozen=frozen)
        current = {name: grant.placement for name, grant in grants.items() if grant.admitted}


# The fast path against the plain algorithm (tests/unit/arbitration_reference.py).


CrowdedCase = tuple[Pool, list[Demand], dict[str, Placement], frozenset[str], frozenset[Slot]]
"""A pool, demands, current placements, frozen jobs and unavailable GPUs."""


@st.composite
def crowded_decisions(draw: st.DrawFn) -> CrowdedCase:
    """A pool, demands and current placements of a busy pool: many jobs, some holding GPUs
    that left the pool, some frozen, some GPUs unavailable; desires anywhere."""
    counts = draw(st.lists(st.integers(1, 8), min_size=1, max_size=12))
    pool = Pool.from_counts({f"h{i}": count for i, count in enumerate(counts)})
    gone_hosts = draw(st.integers(0, 2))
    wider = Pool.from_counts(
        {**{f"h{i}": c for i, c in enumerate(counts)}, **{f"x{i}": 4 for i in range(gone_hosts)}}
    )
    slots = list(wider.slots())
    order = draw(st.permutations(slots))
    demands: list[Demand] = []
    current: dict[str, Placement] = {}
    cursor = 0
    for index in range(draw(st.integers(1, 24))):
        low = draw(st.integers(1, 6))
        high = draw(st.integers(low, low + 10))
        demand = Demand(
            f"job-{index:02d}",
            low,
            high,
            draw(st.integers(0, high + 3)),
            draw(st.integers(0, 2)),
            float(draw(st.integers(0, 6))),
            tuple(draw(st.lists(st.sampled_from([0.0, 0.1, 0.5, 0.9]), max_size=4)))[: high - low],
        )
        demands.append(demand)
        take = draw(st.integers(0, high + 2))
        if take and cursor < len(order):
            held = order[cursor : cursor + take]
            cursor += len(held)
            grouped: dict[str, list[int]] = {}
            for host, gpu in held:
                grouped.setdefault(host, []).append(gpu)
            current[demand.name] = Placement(tuple((h, tuple(g)) for h, g in grouped.items()))
    names = [d.name for d in demands]
    frozen = frozenset(draw(st.lists(st.sampled_from(names), max_size=len(names))))
    unavailable = frozenset(draw(st.lists(st.sampled_from(slots), max_size=len(slots) // 3)))
    return pool, demands, current, frozen, unavailable


def plain_and_with(case: CrowdedCase, **option: bool) -> tuple[dict[str, Grant], dict[str, Grant]]:
    """The plain decision of ``case`` and the one with ``option`` (e.g. share_by_gain)."""
    pool, demands, current, frozen, unavailable = case
    plain = arbitrate(pool, demands, current, frozen=frozen, unavailable=unavailable)
    return plain, arbitrate(
        pool, demands, current, frozen=frozen, unavailable=unavailable, **option
    )


def granted_slots(grants: dict[str, Grant], pool: Pool, unavailable: frozenset[Slot]) -> set[Slot]:
    """Every granted GPU, checked: in the pool, available, and granted to one job only."""
    owners: set[Slot] = set()
    for grant in grants.values():
        slots = set(grant.placement.slots())
        assert not slots & owners and not slots & unavailable and slots <= set(pool.slots())
        owners |= slots
    return owners


@settings(max_examples=400, deadline=None)
@given(case=crowded_decisions())
def test_the_fast_path_decides_as_the_plain_algorithm(
    case: CrowdedCase,
) -> None:
    pool, demands, current, frozen, unavailable = case
    expected = arbitration_reference.arbitrate(
        pool, demands, current, frozen=frozen, unavailable=unavailable
    )
    got = arbitrate(pool, demands, current, frozen=frozen, unavailable=unavailable)
    assert list(got.items()) == list(expected.items())


@settings(max_examples=100, deadline=None)
@given(story=stories(), seed=st.integers(0, 2**32 - 1))
def test_decision_sequences_match_the_plain_algorithm(story: Story, seed: int) -> None:
    # Each step starts from the previous grants, as the allocator's decisions do: most jobs
    # keep their placement, which is what the fast path shortcuts.
    chooser = random.Random(seed)
    current: dict[str, Placement] = {}
    for step in story.steps:
        pool = pool_at(story, step)
        demands = demands_at(story, step)
        frozen = frozen_at(story, step)
        slots = list(pool.slots())
        gone = set(chooser.sample(slots, chooser.randint(0, len(slots) // 4)))
        grants = arbitrate(pool, demands, current, frozen=frozen, unavailable=gone)
        reference = arbitration_reference.arbitrate(
            pool, demands, current, frozen=frozen, unavailable=gone
        )
        assert list(grants.items()) == list(reference.items())
        current = {name: grant.placement for name, grant in grants.items() if grant.admitted}


@settings(max_examples=100, deadline=None)
@given(case=crowded_decisions(), seed=st.integers(0, 2**32 - 1))
def test_previous_grants_come_back_only_for_unchanged_placements(
    case: CrowdedCase,
    seed: int,
) -> None:
    pool, demands, current, frozen, unavailable = case
    fresh = arbitrate(pool, demands, current, frozen=frozen, unavailable=unavailable)
    # Earlier grants: some with the placement this decision makes, some with another one.
    chooser = random.Random(seed)
    previous = {
        name: Grant(
            grant.placement if chooser.random() < 0.7 else Placement.EMPTY, f"earlier {name}"
        )
        for name, grant in fresh.items()
    }
    got = arbitrate(
        pool, demands, current, frozen=frozen, unavailable=unavailable, previous=previous
    )
    assert list(got) == list(fresh)
    for name, grant in got.items():
        same = grant.placement.size and previous[name].placement == grant.placement
        assert grant == (previous[name] if same else fresh[name])


def test_a_large_busy_decision_matches_the_plain_algorithm() -> None:
    # The arbitration benchmark's shape, smaller: hundreds of jobs, half already placed,
    # then desires moved, so that the fair share runs over many levels.
    pool = Pool.from_counts({f"nid{n:04d}": 4 for n in range(128)})
    chooser = random.Random(5)
    demands = []
    for index in range(300):
        low = chooser.randint(1, 4)
        high = low + chooser.choice((0, 0, 2, 4, 12))
        demands.append(
            Demand(
                f"job-{index:03d}",
                low,
                high,
                chooser.randint(low, high),
                chooser.choice((0, 0, 1)),
                float(index),
            )
        )
    first = arbitrate(pool, demands[:150], {})
    assert first == arbitration_reference.arbitrate(pool, demands[:150], {})
    current = {name: grant.placement for name, grant in first.items() if grant.admitted}
    moved = [replace(d, desired=chooser.randint(d.min, d.max)) for d in demands]
    second = arbitrate(pool, moved, current, frozen=frozenset(list(current)[::7]))
    reference = arbitration_reference.arbitrate(
        pool, moved, current, frozen=frozenset(list(current)[::7])
    )
    assert list(second.items()) == list(reference.items())


# Spare GPUs lent by gain (opt-in).


def test_spare_gpus_go_to_the_jobs_whose_next_gpu_adds_most() -> None:
    pool = Pool.from_counts({"n0": 4, "n1": 4})
    demands = [
        Demand("a", 1, 8, 2, arrival=0.0, gains=(1.0, 0.9, 0.8, 0.7, 0.1)),
        Demand("b", 1, 8, 2, arrival=1.0, gains=(1.0, 0.3, 0.2)),
    ]
    plain = arbitrate(pool, demands, {})
    assert [g.placement.size for g in plain.values()] == [2, 2]  # 4 GPUs idle
    lent = arbitrate(pool, demands, {}, spare_by_gain=True)
    # a's 0.9, 0.8, 0.7 beat b's 0.3; then b's 0.3 beats a's 0.1.
    assert [g.placement.size for g in lent.values()] == [5, 3]
    assert lent["a"].reason == (
        "admitted 0 -> 5: min 1 fits, policy wants 2, 3 GPUs more lent by gain"
        " (nobody else wants them)"
    )
    # No gains reported: nothing lent, as without the option.
    silent = [Demand("a", 1, 8, 2), Demand("b", 1, 8, 2, arrival=1.0)]
    assert arbitrate(pool, silent, {}, spare_by_gain=True) == arbitrate(pool, silent, {})


def test_lent_gpus_come_back_when_a_job_waits_for_them() -> None:
    pool = Pool.from_counts({"n0": 4})
    lender = Demand("a", 1, 4, 1, arrival=0.0, gains=(0.9, 0.9, 0.9))
    first = arbitrate(pool, [lender], {}, spare_by_gain=True)
    assert first["a"].placement.size == 4
    current = {"a": first["a"].placement}
    second = arbitrate(
        pool, [lender, Demand("b", 2, 2, 2, arrival=1.0)], current, spare_by_gain=True
    )
    assert (second["a"].placement.size, second["b"].placement.size) == (2, 2)
    assert second["a"].reason == "shrunk 4 -> 2: admitting b (min 2)"
    # A higher tier's wish comes before anyone's spare.
    third = arbitrate(
        pool, [lender, Demand("c", 1, 3, 3, priority=1, arrival=2.0)], current, spare_by_gain=True
    )
    assert (third["a"].placement.size, third["c"].placement.size) == (1, 3)


@settings(max_examples=200, deadline=None)
@given(case=crowded_decisions())
def test_lending_spare_gpus_only_adds_to_what_jobs_get(
    case: CrowdedCase,
) -> None:
    pool, demands, _, frozen, unavailable = case
    plain, lent = plain_and_with(case, spare_by_gain=True)
    by_name = {d.name: d for d in demands}
    for name, grant in lent.items():
        demand = by_name[name]
        size, before = grant.placement.size, plain[name].placement.size
        # The same jobs run; none gets less; nobody is lent past max or past its gains.
        assert grant.admitted == plain[name].admitted
        assert before <= size <= demand.max
        if size > before:
            assert size <= demand.min + len(demand.gains)
    owners = granted_slots(lent, pool, unavailable)
    idle = pool.size - len(owners) - len(unavailable & set(pool.slots()))
    if idle:
        # GPUs left idle: no unfrozen admitted job could be lent one more.
        for name, grant in lent.items():
            demand = by_name[name]
            size = grant.placement.size
            if grant.admitted and name not in frozen and size < demand.max:
                assert size - demand.min >= len(demand.gains), name


def test_a_demand_with_a_bad_gain_is_refused() -> None:
    with pytest.raises(ValueError, match=r"demand a: gains must be finite and >= 0, got -0\.5"):
        Demand("a", 1, 4, 2, gains=(0.5, -0.5))
    with pytest.raises(
        ValueError, match=r"demand a: gains has 4 values, at most max - min = 3 allowed"
    ):
        Demand("a", 1, 4, 2, gains=(0.5, 0.4, 0.3, 0.2))


def test_smallest_first_admits_a_small_job_past_a_large_one_that_does_not_fit() -> None:
    pool = Pool.from_counts({"n0": 4})
    current = {"r": place(("n0", (0, 1, 2)))}
    demands = [
        Demand("r", 3, 3, 3, arrival=0.0),
        Demand("big", 2, 4, 4, arrival=1.0),
        Demand("small", 1, 1, 1, arrival=2.0),
    ]
    # Arrival order: big is head of line, and small waits behind it with a GPU free.
    plain = arbitrate(pool, demands, current)
    assert (plain["big"].placement.size, plain["small"].placement.size) == (0, 0)
    assert plain["small"].reason == "pending: waiting behind big (priority 0)"
    first = arbitrate(pool, demands, current, smallest_first=True)
    assert (first["big"].placement.size, first["small"].placement.size) == (0, 1)
    assert first["big"].reason == "pending: needs 2 GPUs, 0 free"
    # Overdue, big is head of line again: nobody overtakes it.
    aged = arbitrate(pool, demands, current, smallest_first=True, overdue={"big"})
    assert aged == plain
    # Without smallest_first, `overdue` changes nothing.
    assert arbitrate(pool, demands, current, overdue={"big"}) == plain


def test_smallest_first_orders_admissions_by_min_then_arrival_within_a_tier() -> None:
    pool = Pool.from_counts({"n0": 4})
    demands = [
        Demand("a4", 4, 4, 4, arrival=0.0),
        Demand("b2", 2, 2, 2, arrival=1.0),
        Demand("c1", 1, 1, 1, arrival=2.0),
        Demand("d1", 1, 1, 1, arrival=3.0),
        Demand("e2", 2, 2, 2, arrival=4.0, priority=-1),
    ]
    sizes = {n: g.placement.size for n, g in arbitrate(pool, demands, {}).items()}
    assert sizes == {"a4": 4, "b2": 0, "c1": 0, "d1": 0, "e2": 0}
    first = arbitrate(pool, demands, {}, smallest_first=True)
    sizes = {n: g.placement.size for n, g in first.items()}
    # c1, d1, then b2 (min 2); a4 waits; the lower tier e2 comes after the whole tier.
    assert sizes == {"a4": 0, "b2": 2, "c1": 1, "d1": 1, "e2": 0}
    assert list(first) == ["c1", "d1", "b2", "a4", "e2"]
    # Two overdue jobs go first, oldest first.
    aged = arbitrate(pool, demands, {}, smallest_first=True, overdue={"a4", "b2"})
    assert {n: g.placement.size for n, g in aged.items()} == {
        "a4": 4, "b2": 0, "c1": 0, "d1": 0, "e2": 0
    }  # fmt: skip


# Every GPU above the mins divided by gain (opt-in, `share_by_gain`).

GAIN_CURVES: tuple[tuple[float, ...], ...] = ((), (0.9, 0.5, 0.2), (0.6, 0.6, 0.6), (0.5, 0.0, 0.0))
"""Non-increasing, as Amdahl's: () is a job that reports none (a whole GPU up to its wish)."""


def next_gain(demand: Demand, size: int) -> float | None:
    """What GPU `size + 1` adds to `demand` by the rule `share_by_gain` documents, written
    again here so that the test does not read the code it checks."""
    if demand.gains:
        above = size - demand.min
        return demand.gains[above] if above < len(demand.gains) else None
    return 1.0 if size < demand.wanted else None


def total_gain(demand: Demand, size: int) -> float:
    return sum(next_gain(demand, n) or 0.0 for n in range(demand.min, size))


def best_total(demands: Sequence[Demand], free: int) -> float:
    """The largest summed gain of any division of `free` GPUs above the mins (brute force)."""
    choices = []
    for d in demands:
        sizes = [d.min]
        while next_gain(d, sizes[-1]) is not None:
            sizes.append(sizes[-1] + 1)
        choices.append(sizes)
    best = 0.0
    for sizes in itertools.product(*choices):
        if sum(s - d.min for s, d in zip(sizes, demands, strict=True)) <= free:
            best = max(best, sum(total_gain(d, s) for s, d in zip(sizes, demands, strict=True)))
    return best


def small_share_cases() -> list[tuple[int, list[Demand]]]:
    """Every pool of 1-7 GPUs with every pair of jobs drawn from a small set of shapes (min
    1-2, max min+1 or min+3, wish min or max, each gain curve), arrival in list order."""
    shapes = []
    for low, extra, wish_max, curve in itertools.product(
        (1, 2), (1, 3), (False, True), GAIN_CURVES
    ):
        high = low + extra
        shapes.append((low, high, high if wish_max else low, curve[:extra]))
    cases = []
    for size in range(1, 8):
        for first, second in itertools.product(shapes, repeat=2):
            demands = [
                Demand(name, low, high, wish, arrival=float(index), gains=curve)
                for index, (name, (low, high, wish, curve)) in enumerate(
                    zip(("a", "b"), (first, second), strict=True)
                )
            ]
            cases.append((size, demands))
    return cases


def test_sharing_by_gain_divides_every_small_case_by_largest_marginal_gain() -> None:
    checked = 0
    for size, demands in small_share_cases():
        pool = Pool.from_counts({"n0": size})
        shared = arbitrate(pool, demands, {}, share_by_gain=True)
        plain = arbitrate(pool, demands, {})
        sizes = {name: grant.placement.size for name, grant in shared.items()}
        admitted = [d for d in demands if sizes[d.name]]
        # Gang admission is the default's: the same jobs run, each at least its min.
        assert [d.name for d in admitted] == [n for n, g in plain.items() if g.admitted]
        assert sum(sizes.values()) <= size
        for d in admitted:
            assert d.min <= sizes[d.name] <= d.max
            # Never past what its gains (or, reporting none, its wish) give.
            assert sizes[d.name] == d.min or next_gain(d, sizes[d.name] - 1) is not None
        free = size - sum(d.min for d in admitted)
        got = sum(total_gain(d, sizes[d.name]) for d in admitted)
        # Each GPU to the largest marginal gain: with gains that do not rise, the best total.
        assert got == pytest.approx(best_total(admitted, free)), (size, demands, sizes)
        for taker, giver in itertools.permutations(admitted, 2):
            gain = next_gain(taker, sizes[taker.name])
            if gain is not None and sizes[giver.name] > giver.min:
                # The giver's last GPU added at least what the taker's next would; in a tie
                # the giver held fewer before it, or as many and came first.
                last = next_gain(giver, sizes[giver.name] - 1)
                assert last is not None
                assert (-last, sizes[giver.name] - 1, giver.arrival) < (
                    -gain,
                    sizes[taker.name],
                    taker.arrival,
                ), (size, demands, sizes)
        if sum(sizes.values()) < size:  # a GPU idle: nobody could take one more
            assert all(next_gain(d, sizes[d.name]) is None for d in admitted)
        # The order the demands come in changes nothing.
        assert arbitrate(pool, demands[::-1], {}, share_by_gain=True) == shared
        checked += 1
    assert checked == 7 * 32 * 32


def test_sharing_by_gain_gives_each_next_gpu_to_the_job_it_adds_most_to() -> None:
    pool = Pool.from_counts({"n0": 4, "n1": 4})
    demands = [
        # a scales badly, b well; both wish their max (as `static` would).
        Demand("a", 1, 8, 8, arrival=0.0, gains=(0.5, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1)),
        Demand("b", 2, 8, 8, arrival=1.0, gains=(0.9, 0.8, 0.7, 0.6, 0.4, 0.3)),
    ]
    plain = arbitrate(pool, demands, {})
    assert [g.placement.size for g in plain.values()] == [4, 4]  # fair share
    shared = arbitrate(pool, demands, {}, share_by_gain=True)
    # 5 GPUs above the mins: b's 0.9, 0.8, 0.7, 0.6 then a's 0.5.
    assert [g.placement.size for g in shared.values()] == [2, 6]
    assert shared["a"].reason == (
        "admitted 0 -> 2: min 1 fits, policy wants 8, 6 GPUs fewer: GPUs divided by gain"
    )
    # A tie goes to the job holding fewest, then to the earlier arrival.
    even = [Demand(n, 1, 4, 4, arrival=t, gains=(0.5, 0.5, 0.5)) for n, t in (("x", 1), ("y", 0))]
    sizes = arbitrate(Pool.from_counts({"n0": 5}), even, {}, share_by_gain=True)
    assert (sizes["y"].placement.size, sizes["x"].placement.size) == (3, 2)
    # Jobs that report no gains get the fair share up to their wishes, as by default.
    silent = [Demand(n, 1, 8, w, arrival=t) for n, w, t in (("p", 8, 0), ("q", 2, 1), ("r", 8, 2))]
    shared_silent = arbitrate(pool, silent, {}, share_by_gain=True)
    plain_silent = arbitrate(pool, silent, {})
    assert {n: g.placement for n, g in shared_silent.items()} == {
        n: g.placement for n, g in plain_silent.items()
    }


def test_sharing_by_gain_keeps_tiers_frozen_jobs_and_head_of_line() -> None:
    pool = Pool.from_counts({"n0": 8})
    low = Demand("low", 1, 8, 8, arrival=0.0, gains=(0.9,) * 7)
    high = Demand("high", 1, 8, 8, priority=1, arrival=1.0, gains=(0.2,) * 7)
    # The higher tier takes every GPU its gains reach before the lower tier is even admitted,
    # as a higher tier's wish does by default; with one GPU left, the lower tier runs.
    tiers = arbitrate(pool, [low, high], {}, share_by_gain=True)
    assert (tiers["high"].placement.size, tiers["low"].placement.size) == (8, 0)
    capped = replace(high, max=7, gains=(0.2,) * 6)
    tiers = arbitrate(pool, [low, capped], {}, share_by_gain=True)
    assert (tiers["high"].placement.size, tiers["low"].placement.size) == (7, 1)
    # A frozen job keeps its GPUs, whatever its gain.
    current = {"low": place(("n0", (0, 1, 2, 3, 4, 5)))}
    weak = replace(low, gains=(0.1,) * 7)
    strong = Demand("new", 1, 8, 8, arrival=2.0, gains=(0.9,) * 7)
    frozen = arbitrate(pool, [weak, strong], current, frozen={"low"}, share_by_gain=True)
    assert (frozen["low"].placement.size, frozen["new"].placement.size) == (6, 2)
    # Unfrozen, it shrinks to what its gains earn against the newcomer's.
    grants = arbitrate(pool, [weak, strong], current, share_by_gain=True)
    assert (grants["low"].placement.size, grants["new"].placement.size) == (1, 7)
    # A pending job whose min does not fit waits, and nobody behind it is admitted (head of
    # line): the running job takes what its gains reach.
    blocked = Demand("big", 8, 8, 8, arrival=1.5)
    grants = arbitrate(pool, [weak, strong, blocked], current, share_by_gain=True)
    assert {n: g.placement.size for n, g in grants.items()} == {"low": 8, "big": 0, "new": 0}
    assert grants["new"].reason == "pending: waiting behind big (priority 0)"


@settings(max_examples=100, deadline=None)
@given(case=crowded_decisions())
def test_sharing_by_gain_runs_the_same_jobs_within_their_bounds(
    case: CrowdedCase,
) -> None:
    pool, demands, current, frozen, unavailable = case
    plain, shared = plain_and_with(case, share_by_gain=True)
    by_name = {d.name: d for d in demands}
    one_tier = len({d.priority for d in demands}) == 1
    usable = set(pool.slots()) - unavailable
    granted_slots(shared, pool, unavailable)  # checks each GPU is granted once, in the pool
    for name, grant in shared.items():
        demand, size = by_name[name], grant.placement.size
        if one_tier:  # across tiers a higher one may take more and keep a lower one out
            assert grant.admitted == plain[name].admitted
        held = current.get(name, Placement.EMPTY)
        if name in frozen and set(held.slots()) <= usable and held.size >= demand.min:
            assert size == min(held.size, demand.max)  # frozen: kept as it is
        elif grant.admitted:
            assert demand.min <= size <= demand.max
