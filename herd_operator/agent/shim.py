"""The command horovodrun starts on each host, before the user's command.

    python -m herd_operator.agent.shim -- python train.py ...

It asks the allocator which GPUs this job holds on this host, exports them in
local-rank order as CUDA_VISIBLE_DEVICES (so that an unmodified script calling
`torch.cuda.set_device(hvd.local_rank())` lands on the allocator's GPU), and
execs the user's command in its place. On CPU machines the virtual GPU indices
are exported the same way.

It must not fail for a passing reason: Horovod blacklists a host where a
worker fails. When the grant shrank between Horovod's discovery and this
start, the local rank is no longer granted and Horovod is about to remove this
worker: the shim waits (to be bound if the grant grows back, or to be stopped
by Horovod) instead of failing.
"""

from __future__ import annotations

import os
import sys
import time

from herd_operator.agent import worker
from herd_operator.environment import GPU_ENV, GPUS_ENV, JOB_ENV, VIRTUAL_ENV
from herd_operator.rpc import AuthError, RpcError

BIND_WAIT_SECONDS = float(os.environ.get("HERD_BIND_TIMEOUT", "600"))


def bind_environment(env: dict[str, str], reply: dict[str, object], local_rank: int) -> None:
    gpus = [str(gpu) for gpu in reply["gpus"]]  # type: ignore[attr-defined]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    env[GPUS_ENV] = ",".join(gpus)
    env[GPU_ENV] = str(reply["gpu"])
    env[VIRTUAL_ENV] = "1" if reply["virtual"] else "0"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m herd_operator.agent.shim -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if worker.under_operator():
        local_rank = int(env.get("HOROVOD_LOCAL_RANK", "0"))
        client = worker.client_from_env(f"shim:{env[JOB_ENV]}:{worker.host_name()}:{local_rank}")
        deadline = time.monotonic() + BIND_WAIT_SECONDS
        warned = False
        while True:
            try:
                reply = client.call(
                    "bind",
                    job=env[JOB_ENV],
                    host=worker.host_name(),
                    local_rank=local_rank,
                    pid=os.getpid(),  # exec keeps the pid: this is the worker's
                )
                break
            except AuthError as err:  # a wrong token does not fix itself
                print(f"herd shim: the allocator refused us: {err}", file=sys.stderr)
                return 1
            except (RpcError, OSError) as err:
                if time.monotonic() > deadline:
                    print(f"herd shim: cannot bind local rank {local_rank}: {err}", file=sys.stderr)
                    return 1
                if not warned:
                    print(
                        f"herd shim: waiting for a GPU for local rank {local_rank}: {err}",
                        file=sys.stderr,
                        flush=True,
                    )
                    warned = True
                time.sleep(0.5)
        client.close()
        bind_environment(env, reply, local_rank)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as err:
        print(f"herd shim: cannot run {argv[0]!r}: {err}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
