"""`python -m herd_operator.cli ...`: the same as the `herd-operator` command."""

from __future__ import annotations

import sys

from herd_operator.cli.main import main

sys.exit(main())
