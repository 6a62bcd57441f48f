"""Test-only harnesses, imported as ``harness`` (pytest puts ``tests/`` on ``sys.path``; spawned
rank processes inherit that path, so rank functions defined here unpickle in every rank).

They live here rather than in the package because only this suite uses them; users testing their
own loops want the public kit in :mod:`mbridge_mxfp8_plugin.testing` instead. One place per
framework, so a release that changes a framework changes one module:

* megatron-core, faked (unit tier only): ``fake_core``;
* Transformer Engine, stubbed where Bridge and core import it unguarded: ``te_stub``;
* Megatron-Bridge's loop, replayed on the toy model (every release's order, and a loop that stages
  as 0.6 does): ``bridge_loop``, with its pieces ``bridge_orders`` (the releases), ``bridge_state``
  (schedule, state, run record), ``bridge_callbacks`` (Bridge's callbacks, the call record),
  ``bridge_steps`` (``train.py``'s helpers, step and eval), ``bridge_saves`` and ``bridge_staging``
  (the loop API in a loop that stages); its real ``pretrain()``: ``bridge_real/``;
* what both real frameworks need to run on CPU (CUDA asserts, RNG, fused kernels, the torch-Adam
  checkpoint path, the reuse mode's knobs): ``bridge_cpu``;
* Lightning's loop, replayed (with NeMo's order): ``lightning_loop``; NeMo 2's real stack: ``nemo``.

Built on those: the end-to-end scenario runner (``scenarios``), the robustness/misuse case runner
(``robust``), interrupt-and-resume (``resume_loop``), a LayerWise optimizer beside DDP
(``owners``), the ready callback of Megatron-LM main (``ready``), the OCP-rule MXFP8 emulation
(``ocp_mxfp8``), the config rule cases (``mx_cases``), ``check`` and the console script run for
the unit tests (``check_io``, ``console``), the verifier's rank cases (``verify_cases`` on
``verify_loop``) and the run record every loop fills (``weights``).
"""
