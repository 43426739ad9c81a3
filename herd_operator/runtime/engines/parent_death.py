"""Children that die with the process that started them, however it ends.

Imports only the standard library: a test's stand-in parent imports it in a blink.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Sequence

WORKER_DEATH_SIGNAL = signal.SIGTERM
"""What a local worker gets when its driver dies (SIGKILL, the OOM killer): as from a stop,
so a script that checkpoints on SIGTERM still may; the default action ends it."""

_PDEATHSIG_SNIPPET = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]))\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[2]) or os._exit(128 + int(sys.argv[1]))\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def dies_with_parent(argv: Sequence[str], sig: signal.Signals = WORKER_DEATH_SIGNAL) -> list[str]:
    """`argv` run so that it gets `sig` when the thread that starts it ends.

    The parent-death signal (prctl PR_SET_PDEATHSIG) is set in the child, between fork
    and exec, by util-linux's `setpriv` (a small C program: no interpreter start), else
    by a Python one-liner; a `preexec_fn` would run Python in a child forked from this
    threaded process, where a lock held by another thread at the fork never comes free.
    The setting survives `exec` (the shim's and any later one, set-uid programs aside),
    so the worker itself carries it. Linux ties it to the *thread* that forked, not the
    process: the caller must outlive the child, as `run_local_worker`'s thread does (it
    waits for the worker). The caller must be the process that starts it (the one-liner
    checks its parent is still that one).
    """
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", sig.name.removeprefix("SIG"), "--", *argv]
    # The one-liner also closes the window in which the parent died before the prctl.
    snippet = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_SNIPPET]
    return [*snippet, str(int(sig)), str(os.getpid()), *argv]
