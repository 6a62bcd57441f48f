"""What a training loop around megatron-core does at forced param syncs (probes/loops.py).

The installed Megatron-Bridge's files, read as text, must agree with the loop replica's switches
for that release (tests/harness/bridge_orders.py, written from each release's source with line
references), in every release-pair cell. A loop already running is asked through its loaded
module: Bridge >= 0.6 and Megatron-LM core_v0.19 hand the optimizer to ``force_param_sync`` and
``disable_forward_pre_hook`` (so they stage first); the probe imports nothing and says "unknown"
when no loop is loaded. No ranks are spawned here: the probes read files and ``sys.modules``.
"""

from __future__ import annotations

import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.probes.loops import probe_bridge_files, probe_live_loop

pytestmark = pytest.mark.matrix  # every release-pair cell: the installed Bridge differs

BRIDGE, MEGATRON_LM = "megatron.bridge.training.train", "megatron.training.training"


# Moved from tests/ranks/test_matrix.py (unchanged).
def test_replica_loop_order_agrees_with_installed_bridge_source() -> None:
    """The replica's per-release switches, checked against the installed Bridge's own train.py/eval.py."""
    from harness.bridge_loop import loop_order, replica_release

    from mbridge_mxfp8_plugin.probes import probe_bridge_files

    try:
        installed = metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        pytest.skip("no megatron-bridge installed")
    probe = probe_bridge_files()
    assert probe is not None
    order = loop_order(replica_release(installed))  # a newer Bridge (main) must keep the newest order
    assert probe.on_train_start_before_initial_disable == order.on_train_start_before_disable
    assert probe.stages_before_eval == (order.stage_before_eval or order.optimizer_prepares_sync)
    assert probe.stages_before_every_forced_sync == order.optimizer_prepares_sync
    assert probe.on_eval_start_after_model_eval == order.eval_events_inside_evaluate
    assert probe.fires_on_checkpoint_save == order.fires_on_checkpoint_save


def test_no_bridge_files_is_no_answer(tmp_path: Path) -> None:
    assert probe_bridge_files(tmp_path) is None  # a directory without train.py: no Bridge there


def _disable_old(model, param_sync=True): ...


def _disable_new(model, optimizer=None, param_sync=True): ...


def _force_old(model): ...


def _force_new(model, optimizer=None): ...


def _loop_module(name: str, *, takes_optimizer: bool, force_takes_it: bool | None = None) -> types.ModuleType:
    """A loaded loop module with the two helpers, in the signature of the releases before (False)
    and since (True) they stage the main params themselves."""
    mod = types.ModuleType(name)
    force = takes_optimizer if force_takes_it is None else force_takes_it
    mod.disable_forward_pre_hook = _disable_new if takes_optimizer else _disable_old  # type: ignore[attr-defined]
    mod.force_param_sync = _force_new if force else _force_old  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch):
    """No loop module loaded, then the ones a test loads."""
    for name in (BRIDGE, MEGATRON_LM):
        monkeypatch.delitem(sys.modules, name, raising=False)

    def load(name: str, module: types.ModuleType) -> None:
        monkeypatch.setitem(sys.modules, name, module)

    return load


def test_no_loaded_loop_is_unknown_and_nothing_is_imported(loaded) -> None:
    assert probe_live_loop() is None
    assert BRIDGE not in sys.modules and MEGATRON_LM not in sys.modules


@pytest.mark.parametrize("name", [BRIDGE, MEGATRON_LM], ids=["bridge", "megatron-lm"])
@pytest.mark.parametrize("stages", [True, False], ids=["optimizer-helpers", "older-helpers"])
def test_a_loaded_loop_is_asked_through_its_helpers(loaded, name: str, stages: bool) -> None:
    loaded(name, _loop_module(name, takes_optimizer=stages))
    assert probe_live_loop() is stages


def test_both_helpers_must_take_the_optimizer(loaded) -> None:
    """A save's forced sync that does not stage gathers gradients (B2) even if evals stage."""
    loaded(BRIDGE, _loop_module(BRIDGE, takes_optimizer=True, force_takes_it=False))
    assert probe_live_loop() is False


def test_either_loaded_loop_that_stages_is_enough(loaded) -> None:
    loaded(BRIDGE, _loop_module(BRIDGE, takes_optimizer=False))
    loaded(MEGATRON_LM, _loop_module(MEGATRON_LM, takes_optimizer=True))
    assert probe_live_loop() is True


def test_a_loaded_module_without_the_helpers_says_nothing(loaded) -> None:
    loaded(BRIDGE, types.ModuleType(BRIDGE))
    assert probe_live_loop() is None
    loaded(MEGATRON_LM, _loop_module(MEGATRON_LM, takes_optimizer=False))
    assert probe_live_loop() is False
