"""Rank-zero logging that reaches the user under each framework's default logging setup.

One line per job, not per rank (Megatron's ``print_rank_0``, Lightning's ``rank_zero_warn``).

Levels, and why a warning is not logged at ``logging.WARNING``: Megatron-Bridge's
``setup_logging`` (``training/utils/log_utils.py``, run inside ``pretrain()`` with
``LoggerConfig.filter_warnings=True`` by default) adds a filter that drops every record whose
``levelno`` is exactly ``WARNING`` to the root logger and to every logger existing at that moment,
ours included. A plugin that reports problems at WARNING is therefore silent in a default Bridge
job. So:

* problems that make the job train wrong (config-rule errors logged because ``strict=False``)
  are logged at ``ERROR``;
* warnings are logged at :data:`WARNING_LEVEL` (``WARNING + 1``), one above the level Bridge's
  filter drops, and still *shown* as ``WARNING`` (our logger renames them). Level thresholds keep
  their meaning: ``setLevel(logging.WARNING)`` shows them, ``setLevel(logging.ERROR)`` hides them.
  The name is set per record, not with ``logging.addLevelName``, which would also make the name
  ``"WARNING"`` mean 31 everywhere in the process.

With no handler configured anywhere (plain Python, plain Lightning, a Bridge job), Python's
last-resort handler prints both to stderr. ``log_rank_zero(logging.WARNING, ...)`` is mapped to
:data:`WARNING_LEVEL`, so every caller gets the visible level without knowing about the filter.
"""

from __future__ import annotations

import logging

__all__ = ["WARNING_LEVEL", "log_rank_zero", "logger", "show_plugin_messages"]

logger = logging.getLogger("mbridge_mxfp8_plugin")

#: The level plugin warnings are emitted at: above Bridge's ``levelno == WARNING`` filter.
WARNING_LEVEL = logging.WARNING + 1


def _name_warnings(record: logging.LogRecord) -> bool:
    if record.levelno == WARNING_LEVEL:
        record.levelname = "WARNING"
    return True


logger.addFilter(_name_warnings)


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - logging must never raise
        pass
    return 0


def log_rank_zero(level: int, msg: str, *args: object) -> None:
    """Log on global rank 0 only; ``logging.WARNING`` becomes :data:`WARNING_LEVEL` (see above)."""
    if _rank() == 0:
        logger.log(WARNING_LEVEL if level == logging.WARNING else level, msg, *args)


def show_plugin_messages(level: int = logging.INFO) -> None:
    """Print the plugin's own records (from ``level``) on stderr when nothing else would.

    For entry points that own the process (the launcher): a default Bridge job configures no
    handler, so even its root logger at INFO prints nothing but last-resort WARNING+ records, and
    the plugin's "active" summary line would be lost. Lightning does the same for its own logger.
    No-op when the root logger or ours already has a handler (the user configured logging).
    """
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
