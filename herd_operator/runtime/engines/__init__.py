"""The engines a job can run on, one module each, and the registry that names them.

A spec picks its engine by `spec.engine.kind`; adding an engine is its module and one
line in `ENGINES` (and one in `OPTION_CHECKS` when it reads `spec.engine.options`: the
horovod engine's options are the spec's own model, `HorovodOptions`).

Neither engine's third-party package is imported here: the horovod engine's launch
process imports Horovod, the torchrun engine's imports torch, each in its own process. So
an operator without Horovod runs torchrun jobs (`pip install 'herd-operator[torchrun]'`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from herd_operator.runtime.engines.base import (
    Engine,
    EngineContext,
    EngineFactory,
    UnknownEngineError,
)
from herd_operator.runtime.engines.horovod import HorovodEngine
from herd_operator.runtime.engines.torchrun import TorchrunEngine
from herd_operator.runtime.engines.torchrun_options import TorchrunOptions, option_problems
from herd_operator.specs import HerdJobSpec

ENGINES: dict[str, EngineFactory] = {
    "horovod": HorovodEngine,
    "torchrun": TorchrunEngine,
}
OPTION_CHECKS: dict[str, Callable[[Mapping[str, Any]], list[tuple[str, str]]]] = {
    "torchrun": option_problems,
}
"""Each kind's check of `spec.engine.options`: (field, what is wrong) per problem."""
OPTION_MODELS: dict[str, type[BaseModel]] = {
    "torchrun": TorchrunOptions,
}
"""Each kind's options as a model, for the JSON Schema (`herd-operator schema`)."""


def engine_factory(kind: str) -> EngineFactory:
    """The registered engine of this kind; raises UnknownEngineError naming the known ones."""
    factory = ENGINES.get(kind)
    if factory is None:
        raise UnknownEngineError(kind, sorted(ENGINES))
    return factory


def engine_problems(spec: HerdJobSpec) -> list[tuple[str, str]]:
    """Why this operator cannot run the spec's engine: (field, what is wrong) for an
    unknown kind or each bad option of the kind's; none when it can."""
    try:
        engine_factory(spec.engine.kind)
    except UnknownEngineError as err:
        return [(err.field, str(err))]
    check = OPTION_CHECKS.get(spec.engine.kind)
    return [] if check is None else check(spec.engine.options)


__all__ = [
    "ENGINES",
    "OPTION_CHECKS",
    "OPTION_MODELS",
    "Engine",
    "EngineContext",
    "EngineFactory",
    "UnknownEngineError",
    "engine_factory",
    "engine_problems",
]
