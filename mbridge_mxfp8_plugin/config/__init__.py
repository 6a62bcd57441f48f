"""The config column: ``read`` (a recipe file, exactly as Megatron-Bridge reads it) -> ``view``
(the values the job will run with, Bridge's precedence applied) -> ``rules`` -> ``report``.

Nothing here imports torch or megatron-core: the installed releases are read from their files
(:mod:`.schema`, :mod:`..defects`), so ``mxfp8-plugin check`` runs in well under a second.
"""
