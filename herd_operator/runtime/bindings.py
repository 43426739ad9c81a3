"""Which worker is on which GPU: the allocator's binding tracker, and how a job's GPUs are
shown to its workers.

Each worker binds through the RPC (`bind`): it names the job, the host name Horovod gave it
and its local rank, and gets the GPU the job's placement puts there; its pid is kept with
the binding. The bindings say which worker is on a GPU a job gives back (its drain watches
that pid), which slots a job that lost workers gives up first (`slots_to_give_up`), and how
many of a launch's workers run (`pids_by_slot`). A job's engine may show one host under
several names (`Presenter`), so a binding keeps the name the worker used and the pool host
it stands for.

Apart from the allocator's decisions because it changes with every worker's call, not with
demands. Not thread-safe by itself: the allocator calls it under its lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from herd_operator.controllers.ports import Workers
from herd_operator.runtime.process_table import alive, started_since
from herd_operator.specs.values import Grant, Placement, Slot

Presenter = Callable[[str, Placement], Mapping[str, Sequence[Slot]]]
"""(job, placement) -> each host name the job's workers bind with -> the slots under that
name, in local-rank order (the job's engine may show one host under several names)."""


def plain_presentation(job: str, placement: Placement) -> dict[str, tuple[Slot, ...]]:
    """Each host under its own name."""
    return {host: tuple((host, gpu) for gpu in gpus) for host, gpus in placement.hosts}


@dataclass(frozen=True)
class Binding:
    job: str
    host: str
    """The pool host of the GPU."""
    local_rank: int
    gpu: int
    pid: int | None
    name: str = ""
    """The host name the worker bound with ('' when it is `host`); local_rank counts under it."""


class NoSuchWorker(LookupError):
    """A bind that names no GPU of the job: the job holds none, or none at that local rank
    under that host name."""


def slots_to_give_up(
    slots: Sequence[Slot],
    count: int,
    *,
    dead: frozenset[Slot],
    bound: frozenset[Slot],
    names: Mapping[Slot, str],
) -> tuple[Slot, ...]:
    """Which `count` of a job's `slots` to take back when it lost workers.

    First the slots whose bound worker is gone, then slots no worker bound to (its worker
    never came), then slots shown under the same host name as a gone worker's (Horovod
    blacklists the whole name and stops its other workers), then the last ones.
    """
    dead_names = {names[slot] for slot in dead if slot in names}

    def rank(indexed: tuple[int, Slot]) -> tuple[int, int]:
        index, slot = indexed
        if slot in dead:
            tier = 0
        elif slot not in bound:
            tier = 1
        elif names.get(slot) in dead_names:
            tier = 2
        else:
            tier = 3
        return tier, -index

    ranked = sorted(enumerate(slots), key=rank)
    return tuple(slot for _, slot in ranked[: max(count, 0)])


class BindingTracker:
    """The workers' bindings, keyed by (job, host name, local rank), and the presentation
    of each job's placement that they bind through."""

    def __init__(self, present: Presenter, local_hosts: Collection[str]) -> None:
        self._present = present
        self._local_hosts = local_hosts
        self._bindings: dict[tuple[str, str, int], Binding] = {}
        # Each job's bound GPUs, counted: how many a job has bound is asked at each bind of
        # a forming job, which a scan of every binding would make quadratic in a burst.
        self._bound: dict[str, Counter[Slot]] = {}
        # plain_presentation depends on the placement alone, so its answer is kept for the
        # job's current placement (every worker's bind asks for it, and computing it is
        # linear in the placement). Other presenters keep their own (Dispatch.present).
        self._plain_presented: dict[str, tuple[Placement, Mapping[str, Sequence[Slot]]]] = {}

    def presentation(
        self, job: str, placement: Placement, jobs: Collection[str] = ()
    ) -> Mapping[str, Sequence[Slot]]:
        """How `placement` is shown to `job`'s workers; `jobs`: the jobs that hold GPUs now
        (the cache forgets the others)."""
        if self._present is not plain_presentation:
            return self._present(job, placement)
        cached = self._plain_presented.get(job)
        if cached is not None and cached[0] is placement:
            return cached[1]
        presented = plain_presentation(job, placement)
        if len(self._plain_presented) > 2 * len(jobs) + 16:
            # Forget jobs that are gone, so finished jobs' placements are not kept forever.
            self._plain_presented = {
                name: entry for name, entry in self._plain_presented.items() if name in jobs
            }
        self._plain_presented[job] = (placement, presented)
        return presented

    def moves_cleanly(self, job: str, before: Placement, after: Placement) -> bool:
        """Whether `job`'s workers see the change from `before` to `after` as it is: each GPU
        kept keeps its (host name, local rank), and each GPU left takes its (name, rank) with
        it, so the engine stops that worker. (A lone host shown under fewer names than GPUs
        can give a GPU's name and rank to another: the worker would run on, on the old GPU.)"""

        def positions(placement: Placement) -> dict[Slot, tuple[str, int]]:
            shown = self._present(job, placement)
            return {slot: (n, i) for n, slots in shown.items() for i, slot in enumerate(slots)}

        old, new = positions(before), positions(after)
        taken = set(new.values())
        return all(
            new.get(slot) == where if slot in new else where not in taken
            for slot, where in old.items()
        )

    def where(
        self, job: str, name: str, local_rank: int, placement: Placement, jobs: Collection[str]
    ) -> tuple[Slot, tuple[Slot, ...]]:
        """The GPU of `job`'s worker of `local_rank` under host name `name`, and the job's
        GPUs under that name. NoSuchWorker if the placement has no such worker."""
        if not placement.size:
            raise NoSuchWorker(f"job {job!r} holds no GPUs")
        slots = tuple(self.presentation(job, placement, jobs).get(name, ()))
        if local_rank >= len(slots):
            raise NoSuchWorker(
                f"job {job!r} holds {len(slots)} GPU(s) on {name!r}; no local rank {local_rank}"
            )
        return slots[local_rank], slots

    def bind(
        self, job: str, name: str, local_rank: int, pid: int | None, slots: Sequence[Slot]
    ) -> None:
        """Record that `job`'s worker `pid` of `local_rank` under host name `name` is on its
        GPU (`slots`: the job's GPUs under that name, as `where` gave them)."""
        host, gpu = slots[local_rank]
        binding = Binding(job, host, local_rank, gpu, pid, "" if name == host else name)
        self._put((job, name, local_rank), binding)

    def restore(self, bindings: Iterable[Binding], held: Mapping[str, Placement]) -> None:
        """Take the bindings of live workers found after a restart, each matched to its pool
        host through its job's presentation (`Binding.name`, or `host`, is the name the
        worker bound with); bindings of GPUs a job does not hold are dropped."""
        for binding in bindings:
            placement = held.get(binding.job)
            if placement is None:
                continue
            name = binding.name or binding.host
            named = self.presentation(binding.job, placement).get(name, ())
            host = next((h for h, gpu in named if gpu == binding.gpu), None)
            if host is not None:
                self._put((binding.job, name, binding.local_rank), Binding(
                    binding.job, host, binding.local_rank, binding.gpu, binding.pid,
                    "" if name == host else name,
                ))  # fmt: skip

    def keep_matching(self, grants: Mapping[str, Grant]) -> None:
        """After a decision: keep the bindings still true of the jobs' new placements (a
        worker whose local rank now names another GPU, or none, will bind again)."""
        presented: dict[str, Mapping[str, Sequence[Slot]]] = {}
        kept: dict[tuple[str, str, int], Binding] = {}
        for key, binding in self._bindings.items():
            if binding.job not in grants:
                continue
            if binding.job not in presented:
                presented[binding.job] = self._present(binding.job, grants[binding.job].placement)
            named = presented[binding.job].get(binding.name or binding.host, ())
            if binding.local_rank < len(named) and named[binding.local_rank] == (
                binding.host,
                binding.gpu,
            ):
                kept[key] = binding
        self._bindings = kept
        self._bound = {}
        for binding in kept.values():
            self._bound.setdefault(binding.job, Counter())[(binding.host, binding.gpu)] += 1

    def _put(self, key: tuple[str, str, int], binding: Binding) -> None:
        old = self._bindings.get(key)
        if old is not None:
            counts = self._bound[old.job]
            counts[(old.host, old.gpu)] -= 1
            if not counts[(old.host, old.gpu)]:
                del counts[(old.host, old.gpu)]
        self._bindings[key] = binding
        self._bound.setdefault(binding.job, Counter())[(binding.host, binding.gpu)] += 1

    def clear(self) -> None:
        self._bindings.clear()
        self._bound.clear()

    def bound(self, job: str) -> int:
        """How many of the job's GPUs have a bound worker (`len(of_job(job))`, without a
        scan of every binding)."""
        return len(self._bound.get(job, ()))

    def all(self) -> list[Binding]:
        return list(self._bindings.values())

    def of_job(self, job: str) -> dict[Slot, Binding]:
        """The job's bound GPUs and who is on each."""
        return {(b.host, b.gpu): b for b in self._bindings.values() if b.job == job}

    def pids_on(self, job: str, slot: Slot) -> tuple[tuple[str, int], ...]:
        """(host, pid) of `job`'s workers bound to `slot`."""
        return tuple(
            (b.host, b.pid)
            for b in self._bindings.values()
            if b.job == job and (b.host, b.gpu) == slot and b.pid is not None
        )

    def names(self, job: str, placement: Placement) -> dict[Slot, str]:
        """Each of the job's slots -> the host name its worker binds under."""
        return {
            slot: name for name, named in self._present(job, placement).items() for slot in named
        }

    def dead(self, job: str) -> frozenset[Slot]:
        """The job's GPUs whose bound worker ran on this host and is gone."""
        return frozenset(
            slot
            for slot, b in self.of_job(job).items()
            if b.pid is not None and b.host in self._local_hosts and not alive(b.pid)
        )

    def loss(self, job: str, placement: Placement, world_size: int) -> Loss:
        """`job` runs `world_size` workers on `placement`: which of its GPUs it gives up
        (`slots_to_give_up`), and which of those still have a live worker here."""
        slots = placement.slots()
        bound = self.of_job(job)
        dead = self.dead(job)
        given_up = slots_to_give_up(
            slots,
            len(slots) - world_size,
            dead=dead,
            bound=frozenset(bound),
            names=self.names(job, placement),
        )
        running = {
            slot: (worker.host, worker.pid)
            for slot in given_up
            if (worker := bound.get(slot)) is not None
            and worker.pid is not None
            and slot not in dead
            and worker.host in self._local_hosts
        }
        return Loss(given_up, frozenset(slots) - frozenset(given_up), running)

    def pids_by_slot(self, job: str) -> dict[Slot, int]:
        """The pid of the worker bound to each of `job`'s bound GPUs."""
        return {
            (b.host, b.gpu): b.pid
            for b in self._bindings.values()
            if b.job == job and b.pid is not None
        }


@dataclass(frozen=True)
class Loss:
    """What a job that lost workers gives up (`BindingTracker.loss`)."""

    given_up: tuple[Slot, ...]
    kept: frozenset[Slot]
    still_running: Mapping[Slot, tuple[str, int]]
    """Given-up GPUs whose bound worker still runs here: (host, pid). Maybe Horovod is
    about to stop it, maybe the guess of which worker left was wrong: only its exit frees
    the GPU (the job's reports cannot tell which of its GPUs the survivors use)."""


def running_workers(slots: Sequence[Slot], pids: Mapping[Slot, int], since: float) -> Workers:
    """Of a job's `slots`, how many have a bound worker (`pids`) that runs and started at or
    after `since` (a worker of an earlier launch, or another process that got its pid, is
    not one), and which have none. Reads the process table."""
    running = {
        slot for slot in slots if (pid := pids.get(slot)) is not None and started_since(pid, since)
    }
    return Workers(len(running), tuple(slot for slot in slots if slot not in running))
