"""Fixtures shared by several unit test modules."""

from __future__ import annotations

# A fake pynvml in sys.modules, for the NVML, GPU memory and utilization tests.
from tests.unit.fake_pynvml import install_nvml  # noqa: F401

# The test policies, installed as a plug-in distribution (entry points).
from tests.unit.plugin_policy import (  # noqa: F401
    example_plugin_installed,
    plugins_installed,
)

# A real launcher and its exit callback, for the launcher's and the Horovod engine's tests.
from tests.unit.test_launcher import exits, launcher  # noqa: F401

# A real store and allocator with fake processes and specs, for tests that drive the
# reconciler (test_reconciler) or the loop around it (test_control_loop).
from tests.unit.test_reconciler import world  # noqa: F401
