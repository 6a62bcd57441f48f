"""What the installed megatron-core does (probes/core.py), from its two sources: ``check`` reads it
from the files, the engine from the imported classes; on this core both say the same."""

from __future__ import annotations

from mbridge_mxfp8_plugin.config.validate import InstalledStack


def test_installed_stack_probe_matches_this_core():
    """check reads the installed core from its files; the engine decides from the imported
    classes. On this core both must say the same."""
    from mbridge_mxfp8_plugin.probes import probe_bucket_offsets, probe_core

    stack = InstalledStack.detect()
    assert stack.core == probe_core()
    assert stack.core is not None and stack.core.pads_bucket_offsets == probe_bucket_offsets()
    assert ("B1" in stack.defects) == (not stack.core.forced_sync_writes_back)
    assert ("C" in stack.defects) == (not stack.core.has_dispatch_reset)
