"""The exit statuses every command shares: ``check``, the launcher's dry run and its real run.

One table, so that a script (or CI) reading the status of either judge reads the same verdict for
the same config: a refusal is 1 whether ``check`` found the error, the dry run's train-start
check would refuse the job, or the real run's callback refused it under ``strict``.
"""

from __future__ import annotations

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_REFUSED", "TABLE"]

#: no errors: ``check`` passed (warnings allowed unless asked), the job ran or would start
EXIT_OK = 0
#: the config has errors: ``check`` found them, or the train-start check refuses (or would refuse)
#: the job (``validate`` and ``strict`` on)
EXIT_REFUSED = 1
#: the input could not be read or a package is missing: one ``error:`` line naming what and the fix
EXIT_BAD_INPUT = 2

TABLE = {
    EXIT_OK: "no errors: the config passed, the job ran, or a run would start",
    EXIT_REFUSED: "the config has errors: check found them, or the train-start check refuses the job",
    EXIT_BAD_INPUT: "the input could not be read, or a package is missing (one error: line)",
}
