"""The config column, one module per step: ``read`` (a recipe file and its overrides, exactly as
Megatron-Bridge reads them) -> ``view`` (what is written: ``sections`` judges each section's keys
and values against the installed classes, ``issues`` words the problems, ``values`` is the record)
-> ``effective`` (Bridge's precedence: the values the job runs with) -> ``rules`` (grouped by what
they protect) -> ``report`` (table, JSON); ``validate`` runs them.

What the installed releases accept (fields, annotations, the mixed-precision registry, dtype
names, what a recipe function sets) comes from :mod:`..probes`; nothing here reads an upstream
file or knows a release. Nothing here imports torch or megatron-core, so ``mxfp8-plugin check``
stays fast.
"""
