"""What the operator sets up for itself before it serves."""

from __future__ import annotations

import resource

from herd_operator.runtime.operator import raise_descriptor_limit


def test_the_operator_lifts_its_open_file_limit_within_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        got = raise_descriptor_limit(4096)
        expected = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
        assert got == expected == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
