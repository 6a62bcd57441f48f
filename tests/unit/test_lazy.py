"""common/lazy.py: a package's public names load their submodule on first use, once."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (a package already imported here would hide laziness)."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return proc.stdout.strip()


def test_a_name_loads_only_its_submodule_and_is_kept():
    out = _fresh(
        "import sys, mbridge_mxfp8_plugin.probes as p\n"
        "before = 'mbridge_mxfp8_plugin.probes.core' in sys.modules\n"
        "f = p.probe_core\n"
        "print(before, 'mbridge_mxfp8_plugin.probes.core' in sys.modules,"
        " 'mbridge_mxfp8_plugin.probes.hazards' in sys.modules, 'probe_core' in vars(p))"
    )
    assert out == "False True False True", out


def test_an_unknown_name_is_an_attribute_error_and_dir_lists_the_public_names():
    import mbridge_mxfp8_plugin as root
    import mbridge_mxfp8_plugin.probes as probes

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        probes.nope  # noqa: B018
    assert set(probes.__all__) <= set(dir(probes)) and set(root.__all__) <= set(dir(root))
    assert root.PluginOptions.__module__ == "mbridge_mxfp8_plugin.options"
