"""`herd-operator bench`: how much the operator costs next to the training it manages.

Every benchmark reports its median next to a baseline measured in the same run
(ratios hold on a shared machine where absolute times drift). See
docs/benchmarks.md for what each one measures and the latest results.

The registry and the entry point are in `herd_operator.bench.suite`: this
package imports nothing itself, so the child processes of `scale` start light.
"""

from __future__ import annotations
