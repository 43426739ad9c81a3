"""The environment through which the operator tells a job's processes where they stand.

The operator (launcher) sets these; the shim, the worker API and the orphan search read
them. One list, so both sides agree on the names.
"""

from __future__ import annotations

JOB_ENV = "HERD_JOB"
"""The job's name."""
ALLOCATOR_ENV = "HERD_ALLOCATOR"
"""host:port of the allocator's RPC server."""
TOKEN_FILE_ENV = "HERD_TOKEN_FILE"
"""Path of the 0600 file that holds the allocator token (never the token itself)."""
STATE_DIR_ENV = "HERD_STATE_DIR"
"""The operator's state directory (also the CLI's default when set)."""
LAUNCH_ID_ENV = "HERD_LAUNCH_ID"
"""Marks every process of one launch, so a restarted operator finds what a crashed one left."""
GPU_ENV = "HERD_GPU"
"""Set by the shim: the allocator's GPU index of this worker on its host."""
GPUS_ENV = "HERD_GPUS"
"""Set by the shim: the job's GPUs on this host, in local-rank order."""
VIRTUAL_ENV = "HERD_VIRTUAL_GPU"
"""Set by the shim to 1 when the GPUs are virtual (CPU workers)."""
