"""The engines a job can run on, one module each, and the registry that names them.

A spec picks its engine by `spec.engine.kind`; adding an engine is its module and one
line in `ENGINES`.
"""

from __future__ import annotations

from herd_operator.runtime.engines.base import (
    Engine,
    EngineContext,
    EngineFactory,
    UnknownEngineError,
)
from herd_operator.runtime.engines.horovod import HorovodEngine
from herd_operator.specs import HerdJobSpec

ENGINES: dict[str, EngineFactory] = {
    "horovod": HorovodEngine,
}


def engine_factory(kind: str) -> EngineFactory:
    """The registered engine of this kind; raises UnknownEngineError naming the known ones."""
    factory = ENGINES.get(kind)
    if factory is None:
        raise UnknownEngineError(kind, sorted(ENGINES))
    return factory


def engine_problem(spec: HerdJobSpec) -> str | None:
    """Why this operator cannot run the spec's engine (a problem with `UnknownEngineError.field`),
    or None."""
    try:
        engine_factory(spec.engine.kind)
    except UnknownEngineError as err:
        return str(err)
    return None


__all__ = [
    "ENGINES",
    "Engine",
    "EngineContext",
    "EngineFactory",
    "UnknownEngineError",
    "engine_factory",
    "engine_problem",
]
