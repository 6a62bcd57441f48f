"""Test-only harnesses, imported as ``harness`` (pytest puts ``tests/`` on ``sys.path``; spawned
rank processes inherit that path, so rank functions defined here unpickle in every rank).

They live here rather than in the package because only this suite uses them: replicas of
Megatron-Bridge's and Lightning/NeMo's loop orders (``bridge_loop``, ``lightning_loop``), the
end-to-end scenario runner (``scenarios``) and the robustness/misuse case runner (``robust``).
Users testing their own loops want the public kit in :mod:`mbridge_mxfp8_plugin.testing` instead.
"""
