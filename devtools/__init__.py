"""The project's own development tooling: what measures and exercises herd-operator while
it is being built, and is not part of what users install.

Apart from `herd_operator` because a user measuring their own site runs none of it (the
rule is in `herd_operator.bench`'s docstring and docs/benchmarks.md): the developer
benchmarks (`devtools.bench`, run with `python -m devtools.bench` from the checkout's
root) and the multi-host harness of network namespaces and a real Slurm
(`devtools.cluster`) that the integration tests and `multinode-resize` use. setuptools
does not install it (pyproject.toml lists the packages it does; tests/test_packaging.py
checks that the wheel holds no `devtools`). It may import `herd_operator`; `herd_operator`
never imports it (an import-linter contract). Tests import it as a package: pytest puts
the checkout's root on `sys.path`.
"""

from __future__ import annotations
