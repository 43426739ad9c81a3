"""`herd-operator bench`: how much the operator costs next to the training it manages.

Every benchmark reports its median next to a baseline measured in the same run
(ratios hold on a shared machine where absolute times drift). See
docs/benchmarks.md for what each one measures and the latest results.

What is here, and what is not: a benchmark belongs to the installed package when it
answers a question a user has about their own site, on the machine where they run it:
the allocator's decision time (`arbitration`), the control loop from a spec file to a
launch and from a decision to a grant, at their job count (`spec-to-launch`,
`decision-to-grant`, `scale`), what a job's driver and its discovery cost on the operator's
node (`discovery-cost`, `driver-idle-cpu`, `idle-jobs`), the stall of a resize and the
throughput of training on their nodes (`resize-stall`, `training-overhead`), and the
metrics scrape (`scrape`). The project's own development tooling is not installed: it lives
in the checkout's top-level `devtools/` (load generators and floods against the RPC server
with Redis as the baseline, the network-namespace cluster, the synthetic long history, the
half-hour soak), which `python -m devtools.bench` runs together with these. `devtools`
imports this package; nothing here imports `devtools` (an import-linter contract).

The registry and the entry point are in `herd_operator.bench.suite`: this
package imports nothing itself, so the child processes of `scale` start light.
"""

from __future__ import annotations
