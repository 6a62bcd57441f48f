"""The values ``check``'s rules see are the values Megatron-Bridge's own reader produces.

For every YAML under ``recipes/`` and ``tests/data`` (and a few override lists), the expected
values come from the installed Bridge's ``training/utils/omegaconf_utils.py`` - loaded by file
path (it is pure Python over torch, OmegaConf and Hydra), never re-implemented here - run
the way its ``--config-file`` examples run it: base config to OmegaConf, ``OmegaConf.load``,
``OmegaConf.merge``, ``parse_hydra_overrides``, ``to_container(resolve=True)``. The base is a
small dataclass holding megatron-core's real DDP and optimizer configs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
from harness.mx_cases import ROOT

pytest.importorskip("omegaconf")
pytest.importorskip("hydra")

from mbridge_mxfp8_plugin.config.read import RecipeError, read_recipe_file  # noqa: E402
from mbridge_mxfp8_plugin.config.view import read_config  # noqa: E402
from mbridge_mxfp8_plugin.options import PLUGIN_SECTION  # noqa: E402

FILES = sorted((ROOT / "recipes").glob("*.yaml")) + sorted((ROOT / "tests" / "data").glob("*.yaml"))
OVERRIDES = [
    [],
    ["optimizer.lr=3e-4", "ddp.bucket_size=4e7", "++model.seq_length=128"],
    ["ddp.overlap_param_gather=false", "~optimizer.overlap_param_gather", "mxfp8_plugin.strict=false"],
]


def _bridge_omegaconf_utils() -> types.ModuleType:
    from harness.bridge_loop import find_bridge_file

    try:
        path = find_bridge_file("training/utils/omegaconf_utils.py")
    except FileNotFoundError:
        pytest.skip("megatron-bridge wheel not installed")
    # Bridge >= 0.6 imports its activation_map helpers; load that file by path too, so the
    # package's __init__ (which needs Transformer Engine) never runs.
    amap = path.parent.parent.parent / "utils" / "activation_map.py"
    if amap.is_file() and "megatron.bridge.utils.activation_map" not in sys.modules:
        spec = importlib.util.spec_from_file_location("megatron.bridge.utils.activation_map", amap)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["megatron.bridge.utils.activation_map"] = module
    spec = importlib.util.spec_from_file_location("_bridge_omegaconf_utils", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Stand-ins for the ConfigContainer sections the rules read (Bridge's own classes need its imports).
# Alike in shape to other tests' stand-ins (duplicates lists them), deliberately: each holds only the
# fields and defaults its own test reads.
@dataclasses.dataclass
class _Model:
    seq_length: int = 4096
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None


@dataclasses.dataclass
class _Dist:
    use_megatron_fsdp: bool = False


@dataclasses.dataclass
class _CommOverlap:
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None


def _base() -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    @dataclasses.dataclass
    class Base:
        ddp: Any = dataclasses.field(default_factory=DistributedDataParallelConfig)
        optimizer: Any = dataclasses.field(default_factory=lambda: OptimizerConfig(lr=1e-3))
        model: Any = dataclasses.field(default_factory=_Model)
        dist: Any = dataclasses.field(default_factory=_Dist)
        comm_overlap: Any = dataclasses.field(default_factory=_CommOverlap)
        mixed_precision: Any = "bf16_mixed"

    return Base()


def _bridge_values(utils: types.ModuleType, path: Path, overrides: list[str]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged, _ = utils.create_omegaconf_dict_config(_base())
        merged = OmegaConf.merge(merged, OmegaConf.load(path))
        if overrides:
            merged = utils.parse_hydra_overrides(merged, overrides)
        return OmegaConf.to_container(merged, resolve=True)


def _readable(path: Path, overrides: list[str]) -> bool:
    try:
        read_recipe_file(path, overrides)
    except RecipeError:
        return False
    return True


@pytest.fixture(scope="module")
def bridge_utils() -> types.ModuleType:
    return _bridge_omegaconf_utils()


#: Files Bridge's reader would take minutes and gigabytes on (that is why check bounds them).
HOSTILE = {"bad_anchor_bomb.yaml", "bad_anchor_bomb_unknown_key.yaml", "bad_interpolation_fanout.yaml"}


@pytest.mark.parametrize("overrides", OVERRIDES, ids=lambda o: " ".join(o) or "no-overrides")
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_rules_see_what_bridge_reads(bridge_utils, path: Path, overrides: list[str]):
    if path.name in HOSTILE:
        assert not _readable(path, overrides)
        return
    if not _readable(path, overrides):
        with pytest.raises(Exception):  # noqa: B017 - Bridge refuses it too, with its own error
            _bridge_values(bridge_utils, path, overrides)
        return
    try:
        final = _bridge_values(bridge_utils, path, overrides)
    except Exception as exc:  # noqa: BLE001
        # Bridge applies overrides in struct mode onto base + file: ``key=value`` for a key in
        # neither is refused ("use +key"). check has no base, so it cannot tell; nothing else
        # may differ.
        assert "Could not override" in repr(exc.__cause__ or exc) or "Could not override" in str(exc), exc
        return
    recipe = read_recipe_file(path, overrides)
    view = read_config(recipe.data)
    compared = 0
    for section, knobs in view.sections.items():
        for knob, value in knobs.items():
            expected = final[section][knob]
            assert (value, type(value)) == (expected, type(expected)), f"{section}.{knob}"
            compared += 1
    if isinstance(final.get("mixed_precision"), dict) and "_target_" not in final["mixed_precision"]:
        for knob, value in (view.mp_values or {}).items():
            assert value == final["mixed_precision"][knob], f"mixed_precision.{knob}"
            compared += 1
    elif view.mp_name is not None and isinstance(final.get("mixed_precision"), str):
        assert view.mp_name == final["mixed_precision"].replace("-", "_")
    if isinstance(final.get(PLUGIN_SECTION), dict):
        for knob, value in final[PLUGIN_SECTION].items():
            assert view.plugin[knob] == value, f"{PLUGIN_SECTION}.{knob}"
            compared += 1
    # Interpolations into the base: unknown to check, resolved by Bridge against its base.
    for dotted in recipe.base_refs:
        section, _, knob = dotted.partition(".")
        assert knob not in view.sections.get(section, {}), dotted
    assert compared or not any(k in final for k in ("ddp", "optimizer")), "nothing compared"
