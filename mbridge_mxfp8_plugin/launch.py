"""``torchrun -m mbridge_mxfp8_plugin.launch``: the launcher's public entry (docs/launch.md).

The launcher lives in :mod:`mbridge_mxfp8_plugin.commands.launch`.
"""

from .commands.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
