"""``python -m mbridge_mxfp8_plugin ...`` is the ``mxfp8-plugin`` console script."""

from .commands.cli import console_main

console_main()
