"""`spec.dependsOn` across specs: a job that depends on itself, and dependency cycles.

Apart from the loader because it is a check over several specs at once (a directory, or
the files given to `validate`), where every other check looks at one file; pure, so that
the operator's spec directory and `validate` refuse the same specs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DEPENDS_ON_FIELD = "spec.dependsOn"


def self_dependency(name: str, depends_on: Sequence[str]) -> str | None:
    """Why a job that names itself in `dependsOn` cannot run (None when it does not)."""
    if name in depends_on:
        return f"names the job itself ({name!r}): it would wait for its own success forever"
    return None


def dependency_cycles(graph: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Each job on a dependency cycle, with one cycle through it (starting and ending at
    it: ``[a, b, a]``). ``graph`` maps a job to the jobs it depends on; a name it does not
    hold (a job not declared here) ends a path.

    A job is on a cycle when its strongly connected component (Tarjan's, iterative: a chain
    of any length) has more than one job, or it names itself. The cycle shown is the
    shortest through the first job of the component without one yet (breadth first within
    the component), turned to start at each job on it: one search per cycle found, not one
    per job (a ring of 5,000 jobs is one search)."""
    cycles: dict[str, list[str]] = {}
    for component in _components(graph):
        members = set(component)
        for member in sorted(component):
            if member in cycles:
                continue
            cycle = _shortest_cycle(graph, member, members)
            if cycle is None:
                continue
            ring = cycle[:-1]
            for index, other in enumerate(ring):
                cycles.setdefault(other, [*ring[index:], *ring[:index], other])
    return cycles


def _components(graph: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(set(graph[root]))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(set(graph[child])))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


def _shortest_cycle(
    graph: Mapping[str, Sequence[str]], start: str, members: set[str]
) -> list[str] | None:
    """The shortest path from ``start`` back to itself within ``members`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(set(graph[node])):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child in members and child not in came_from and child != start:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    return None


MAX_CYCLE_SHOWN = 8
"""Jobs of a cycle a message names; a longer one is cut in its middle."""


def cycle_message(cycle: Sequence[str]) -> str:
    shown = list(cycle)
    if len(shown) > MAX_CYCLE_SHOWN + 1:
        left = len(shown) - MAX_CYCLE_SHOWN
        shown = [
            *shown[: MAX_CYCLE_SHOWN // 2],
            f"... {left} more",
            *shown[-MAX_CYCLE_SHOWN // 2 :],
        ]
    return f"a dependency cycle ({' -> '.join(shown)}): none of these jobs could ever start"
