"""Who re-derives the MXFP8 params from the fp32 main params after a checkpoint load (probes/resume.py).

Defect F is fixed upstream two ways (docs/upstream.md): Megatron-Bridge's ``train()`` keeps the
forward pre-hooks on for the first step of an MXFP8 resume (Bridge 0.6.0, #5066), or Megatron-LM's
checkpoint loader calls ``refresh_model_params_from_main_params`` after the load (#6666). The probe
reads those as text for ``doctor``, and asks the loaded loader modules at run time. Here: training
directories in both shapes, loader files and loaded modules that do and do not re-derive, and the
installed Bridge, whose answer follows its release (checked in every release-pair cell).
"""

from __future__ import annotations

import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.probes import resume
from mbridge_mxfp8_plugin.probes.resume import (
    REFRESH_AFTER_LOAD,
    ResumeBehaviour,
    loop_rederives_after_load,
    probe_resume_files,
)

pytestmark = pytest.mark.matrix  # the installed Bridge differs per release-pair cell

LOADERS = ("megatron.training.checkpointing", "megatron.bridge.training.checkpointing")

#: ``train()`` as Bridge <= 0.5 has it: the first step always runs with the pre-hooks off.
TRAIN_OFF = """
def train(model, config, start_iteration):
    should_toggle_forward_pre_hook = should_disable_forward_pre_hook(config)
    if should_toggle_forward_pre_hook:
        disable_forward_pre_hook(model, param_sync=False)
    while iteration < config.train_iters:
        pass
"""
#: ... and as Bridge 0.6 has it (#5066): not for the first step of an MXFP8 resume.
TRAIN_KEEPS_ON = """
def train(model, config, start_iteration):
    should_toggle_forward_pre_hook = should_disable_forward_pre_hook(config)
    if should_toggle_forward_pre_hook:
        is_mxfp8_resume = start_iteration > 0 and str(model_config.fp8_recipe).lower().endswith("mxfp8")
        if not is_mxfp8_resume:
            disable_forward_pre_hook(model, param_sync=False)
    while iteration < config.train_iters:
        pass
"""


def _training_dir(tmp_path: Path, train_py: str) -> Path:
    root = tmp_path / "training"
    root.mkdir(parents=True)
    (root / "train.py").write_text(textwrap.dedent(train_py))
    return root


@pytest.mark.parametrize(
    ("keeps", "rederives", "fixed"),
    [
        (True, False, True),
        (False, True, True),
        (None, True, True),
        (False, False, False),
        (None, False, False),
    ],
)
def test_either_upstream_fix_fixes_f(keeps, rederives, fixed) -> None:
    assert ResumeBehaviour(keeps, rederives).loop_fixes_f is fixed


def test_the_bridge_loop_shapes_are_told_apart(tmp_path: Path) -> None:
    keeps = probe_resume_files(_training_dir(tmp_path / "a", TRAIN_KEEPS_ON))
    off = probe_resume_files(_training_dir(tmp_path / "b", TRAIN_OFF))
    assert keeps.keeps_prehooks_on_mxfp8_resume is True
    assert off.keeps_prehooks_on_mxfp8_resume is False
    # A condition on the start iteration alone is not the MXFP8 resume (a bf16 resume keeps it off).
    other = TRAIN_KEEPS_ON.replace("is_mxfp8_resume", "is_resume").replace(
        ' and str(model_config.fp8_recipe).lower().endswith("mxfp8")', ""
    )
    plain = probe_resume_files(_training_dir(tmp_path / "c", other))
    assert plain.keeps_prehooks_on_mxfp8_resume is False
    # Nor is an MXFP8 condition without the start iteration (a fresh MXFP8 run keeps them off).
    always = TRAIN_KEEPS_ON.replace("start_iteration > 0 and ", "")
    fresh = probe_resume_files(_training_dir(tmp_path / "d", always))
    assert fresh.keeps_prehooks_on_mxfp8_resume is False


def test_a_loader_that_rederives_is_found_in_its_file(tmp_path: Path, monkeypatch) -> None:
    loop_dir = _training_dir(tmp_path, TRAIN_OFF)
    before = probe_resume_files(loop_dir)
    site = tmp_path / "site"
    loader = site / "megatron" / "training" / "checkpointing.py"
    loader.parent.mkdir(parents=True)
    loader.write_text(f"def load_checkpoint(model, optimizer):\n    optimizer.{REFRESH_AFTER_LOAD}()\n")
    monkeypatch.syspath_prepend(str(site))  # megatron is a namespace package: one more directory
    after = probe_resume_files(loop_dir)
    assert not before.loader_rederives and after.loader_rederives and after.loop_fixes_f


@pytest.fixture
def no_loaders(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LOADERS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    return monkeypatch


def test_no_loaded_loader_does_not_rederive(no_loaders) -> None:
    assert loop_rederives_after_load() is False
    plain = types.ModuleType(LOADERS[1])
    plain.load_checkpoint = lambda *a: None  # type: ignore[attr-defined]
    no_loaders.setitem(sys.modules, LOADERS[1], plain)
    assert loop_rederives_after_load() is False


@pytest.mark.parametrize("name", LOADERS)
def test_a_loaded_loader_that_rederives_is_found(no_loaders, name: str) -> None:
    mod = types.ModuleType(name)
    setattr(mod, REFRESH_AFTER_LOAD, lambda *a: None)
    no_loaders.setitem(sys.modules, name, mod)
    assert loop_rederives_after_load() is True


def test_a_loaded_loader_that_calls_it_inside_a_function_is_found(no_loaders, tmp_path: Path) -> None:
    """#6666 calls the optimizer's method from ``load_checkpoint``; the module has no such name."""
    import importlib.util

    path = tmp_path / "loader_6666.py"
    path.write_text(f"def load_checkpoint(model, optimizer):\n    optimizer.{REFRESH_AFTER_LOAD}()\n")
    spec = importlib.util.spec_from_file_location(LOADERS[0], path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not hasattr(mod, REFRESH_AFTER_LOAD)
    no_loaders.setitem(sys.modules, LOADERS[0], mod)
    assert loop_rederives_after_load() is True


def test_the_installed_bridge_keeps_prehooks_on_from_0_6() -> None:
    """docs/upstream.md: F is fixed in Megatron-Bridge 0.6.0 (#5066), present before."""
    from packaging.version import Version

    try:
        installed = metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        assert resume.megatron_subdir("bridge/training", "train.py") is None
        assert probe_resume_files().keeps_prehooks_on_mxfp8_resume is None
        return
    found = probe_resume_files()
    assert found.keeps_prehooks_on_mxfp8_resume is (Version(installed) >= Version("0.6.0")), installed
