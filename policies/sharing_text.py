"""What the sharing decision says in words: the operator's start-up line for its settings
and each sharing job's reason (`sharing.py` decides; apart from it to keep each module short
enough to read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from herd_operator.specs.values import Demand

if TYPE_CHECKING:
    from herd_operator.policies.sharing import SharingLimits
    from herd_operator.policies.sharing_room import GpuRoom


def format_bytes(count: int) -> str:
    """`8.0Gi`-style, as a spec writes a quantity."""
    for unit, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return f"{count}"


def describe_sharing(limits: SharingLimits | None) -> str:
    """For the operator's start-up log line: whether and how GPUs are shared."""
    if limits is None:
        return "GPUs not shared"
    memory = limits.gpu_memory_bytes
    each = f"{format_bytes(memory)} each" if memory is not None else "the pool's memory each"
    cap = limits.max_utilization
    parts = [
        f"GPUs shared by memory ({each}, at most {limits.max_jobs_per_gpu} jobs per GPU",
        f"margin {limits.margin:.0%}",
        "no utilization cap" if cap is None else f"summed utilization at most {cap:g}",
        "whole GPUs first" if limits.whole_first else "shared GPUs first",
        "shrinking sharing jobs to admit" if limits.shrink_to_admit else "no shrink to admit",
    ]
    if limits.backfill:
        parts.append("backfill")
    if limits.admit_first:
        parts.append("admission first")
    if limits.share_to_admit:
        parts.append("sharing only to admit")
    if limits.light_growth:
        parts.append("growing onto light GPUs only")
    if limits.move_apart:
        parts.append("moving workers off crowded GPUs onto free ones")
    if limits.share_when_waiting:
        parts.append(
            "sized by the division of whole GPUs, sharing only to admit who it leaves waiting"
        )
    return ", ".join(parts) + ")"


def pending_reason(
    demand: Demand, need: int, fits: int, before: int, gpus: GpuRoom, pool_size: int
) -> str:
    memory = gpus.capacity if gpus.known else None
    if demand.min > pool_size:
        why = (
            f"spec.gpus.min: {demand.min} is above the pool's {pool_size} GPU(s) (a sharing"
            " job's workers each take a GPU of their own)"
        )
    elif memory is not None and need > memory:
        field = "spec.gpus.memory" if need == (demand.memory_bytes or 0) else "measured peak"
        why = (
            f"{field}: {format_bytes(need)} per worker is above the pool's GPU memory"
            f" ({format_bytes(memory)})"
        )
    else:
        each = f" with {format_bytes(need)} free" if memory is not None else ""
        why = f"needs {demand.min} GPU(s){each} for sharing, {fits} found"
    return f"pending {before} -> 0: {why}" if before else f"pending: {why}"


def placed_reason(demand: Demand, need: int, before: int, size: int, moved: int | None) -> str:
    share = f"sharing, {format_bytes(need)} per worker"
    if before == 0:
        return f"admitted 0 -> {size}: min {demand.min} fits ({share})"
    if size == before and moved:
        return f"holding {size}: {moved} worker(s) moved off shared GPUs to free ones ({share})"
    if size == before:
        return f"holding {size}: policy wants {demand.wanted} ({share})"
    verb = "grown" if size > before else "shrunk"
    return f"{verb} {before} -> {size}: policy wants {demand.wanted} ({share})"
