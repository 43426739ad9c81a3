"""`python -m devtools.bench`: every benchmark, the product's and the developer's."""

from __future__ import annotations

from devtools.bench.suite import main

raise SystemExit(main())
