"""The config column, one module per step: ``read`` (a recipe file and its overrides, exactly as
Megatron-Bridge reads them) -> ``view`` (what is written, each value judged as the installed
Bridge converts it) -> ``effective`` (Bridge's precedence: the values the job runs with) ->
``rules`` (grouped by what they protect) -> ``report`` (table, JSON); ``validate`` runs them.

``schema`` holds the Bridge facts written down; ``installed`` reads what the installed releases
accept from their files. Nothing here imports torch or megatron-core, so ``mxfp8-plugin check``
stays well under a second.
"""
