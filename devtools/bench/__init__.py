"""The developer benchmarks: what the project measures about itself, not installed.

Each is a `herd_operator.bench.harness.Benchmark` like those of `herd-operator bench`,
with the same results files; `devtools.bench.suite` registers them after the product's
and `python -m devtools.bench` runs them all (`--only NAME[,NAME]` to pick):

- `multinode-resize`: a resize across hosts that are network namespaces of this machine
  (`devtools.cluster`; needs root and openssh-server);
- `allocator-rpc` and `rpc-flood`: the RPC server under generated load (`rpcdrive`'s
  processes, 7,168 workers binding at once) and a flood of idle connections, with Redis as
  the baseline (`rpcload` and `rpcscale` hold their servers and figures);
- `history`: a synthetic long history of 10,000 jobs against the store's bounds;
- `soak`: a real `herd-operator run` for half an hour, watched for leaks.

Like `herd_operator.bench`, this package imports nothing itself: `rpcdrive` runs as a
child process (`python -m devtools.bench.rpcdrive`) and starts light.
"""

from __future__ import annotations
