"""Taking crowded GPUs apart when GPUs free up (`SharingLimits.move_apart`): a running
sharing job's worker on a crowded GPU (the jobs there sum past `LIGHT_TOGETHER`, 1.0, of
utilization) moves to a GPU no job uses, so that a GPU stays crowded only while no GPU is free.

Pure, as `sharing.py` (which calls it and documents the rules); apart from it to keep each
module short enough to read. The rules:

- It runs after the waiting jobs were admitted (and the head of the line shrank others for)
  and before the running jobs grow: a free GPU goes to a waiting job first, then to taking
  a crowded GPU apart, then to growth. Two or three jobs slowed by their neighbours (up to
  1.25 times under the simulator's cap) gain more from one GPU than one job does from one
  more worker.
- Only crowded GPUs: beside light jobs a worker slows its neighbours little (at most 1.10 in
  the simulator's model), and a move stalls its job (a Horovod reset) and drains the GPU it
  leaves; moving those too cost more than it saved in the model (docs/simulation.md).
- Not while a waiting job that could fit once GPUs free up is kept waiting for them (the
  free GPUs are kept for it, as they are against growth), and not for a job that may not
  open a free GPU (a whole-GPU job of its priority or higher waits) or that is frozen
  (resized recently: a move is a resize).
- Jobs in rank order; for each, its workers on crowded GPUs, in the order it holds them, each
  to a free GPU that holds it (on its own hosts first). The worker leaves; the jobs still on
  that GPU stay (a GPU no longer crowded keeps its other jobs).
- The job keeps its size (the memory per worker is the same) and the order of its GPUs,
  with the new one where the old one was.
"""

from __future__ import annotations

from collections.abc import Mapping

from herd_operator.policies.sharing_room import LIGHT_TOGETHER, Packing


def move_apart(packing: Packing, may_open: Mapping[str, bool]) -> dict[str, int]:
    """Move workers off crowded GPUs onto free ones (the module docstring's rules), updating
    the packing's `held`, `gpus` and `where` in place; the workers moved, per job (none
    moved: empty)."""
    held, needs, gpus, where = packing.held, packing.needs, packing.gpus, packing.where
    moved: dict[str, int] = {}
    for d in packing.ranked:
        mine = held[d.name]
        if len(mine) < d.min or d.name in packing.frozen or not may_open.get(d.name, True):
            continue
        need = needs.at(d, len(mine))
        for index, slot in enumerate(mine):
            if len(gpus.jobs.get(slot, ())) < 2 or gpus.busy[slot] <= LIGHT_TOGETHER + 1e-9:
                continue  # alone, or with light jobs: it slows its neighbours little
            free = where.free_for(d.name, mine, need)
            if free is None:
                break  # none left that holds its worker
            gpus.remove(slot, d.name, need)
            gpus.add(free, d.name, need)
            mine[index] = free
            moved[d.name] = moved.get(d.name, 0) + 1
    return moved
