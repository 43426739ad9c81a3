"""What runs inside jobs and on each node, next to the user's training.

`shim` (binds a worker to its GPUs, then execs the user's command), `worker` (the
API scripts call; public as `herd_operator.worker`) and `exporter` (one node's GPU
metrics). They talk to the operator only over the authenticated RPC (`herd_operator.rpc`'s
client and protocol, `herd_operator.auth`) and the environment it sets
(`herd_operator.environment`); they import nothing of the runtime, the RPC server, the CLI
or the decision packages, so a worker starts light.
"""
