"""The installed release pair as ``check`` knows it (probes/stack.py): without megatron-core its
defects are unknown, never "none"."""

from __future__ import annotations

import json

from harness.check_io import run as _run
from harness.check_io import without_plugin_section as _without_plugin_section


def test_no_megatron_core_means_defects_unknown_not_none(tmp_path):
    from mbridge_mxfp8_plugin.probes import InstalledStack

    nothing = InstalledStack(core=None, bridge_calls_prepare=None, versions={})
    assert "defects: unknown" in nothing.describe() and "none" not in nothing.describe()
    assert nothing.defects == [] and not nothing.defects_known
    code, out, _ = _run(_without_plugin_section(tmp_path), installed=nothing, as_json=True)
    payload = json.loads(out)
    (mx009,) = [r for r in payload["rules"] if r["id"] == "MX009"]
    assert mx009["status"] == "n/a" and "unknown" in mx009["note"]
    assert "defects: unknown" in payload["installed"]
