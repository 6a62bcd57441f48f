"""The hard-coded Megatron-Bridge facts in probes/bridge_facts.py, checked against the installed
Bridge wheel's sources (and the dtype names read from a file in Bridge's shape)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from harness.mx_cases import DEFECTIVE, TINY

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import validate_config
from mbridge_mxfp8_plugin.probes import bridge_facts as installed
from mbridge_mxfp8_plugin.probes.bridge_facts import (
    CONFIG_SECTIONS,
    MIXED_PRECISION_FIELDS,
    MIXED_PRECISION_RECIPES,
)


def _bridge_source(relative: str) -> ast.Module:
    from harness.bridge_loop import find_bridge_file

    try:
        path: Path = find_bridge_file(relative)
    except FileNotFoundError:
        pytest.skip("megatron-bridge wheel not installed")
    return ast.parse(path.read_text())


def _class_fields(tree: ast.Module, name: str) -> set[str]:
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def test_schema_knows_the_installed_bridge():
    mp = _bridge_source("training/mixed_precision.py")
    registered = {
        n.name
        for n in mp.body
        if isinstance(n, ast.FunctionDef)
        and any(getattr(d, "id", None) == "register" for d in n.decorator_list)
    }
    assert registered <= set(MIXED_PRECISION_RECIPES)
    assert _class_fields(mp, "MixedPrecisionConfig") <= set(MIXED_PRECISION_FIELDS)
    container = _class_fields(_bridge_source("training/config.py"), "ConfigContainer")
    assert {f for f in container if not f.startswith("_")} <= CONFIG_SECTIONS


def test_schema_mxfp8_recipe_values_match_bridge():
    """The knob values we assume for each recipe, against the assignments in Bridge's source."""
    mp = _bridge_source("training/mixed_precision.py")
    funcs = {n.name: n for n in mp.body if isinstance(n, ast.FunctionDef)}
    for name in ("bf16_with_mxfp8_mixed", "fp16_with_mxfp8_mixed", "bf16_with_fp8_subchannel_scaling_mixed"):
        assigned = {
            s.targets[0].attr: ast.literal_eval(s.value)
            for s in funcs[name].body
            if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Attribute)
        }
        for knob, value in assigned.items():
            if knob in MIXED_PRECISION_RECIPES[name]:
                assert MIXED_PRECISION_RECIPES[name][knob] == value, (name, knob)


def test_bridge_06_dtype_map_is_read_from_its_file(tmp_path):
    """Bridge >= 0.4 converts through ``str_to_dtype``: its DTYPE_MAP (here a file of ours in the
    same shape) decides, ``torch.`` aliases included; without the file, torch attribute names."""
    f = tmp_path / "activation_map.py"
    f.write_text(
        'import torch\nDTYPE_MAP: dict = {"bf16": torch.bfloat16, "fp32": torch.float32, "16-mixed": 1}\n'
    )
    names = installed._bridge_dtype_names(f)
    assert {"bf16", "torch.bf16", "fp32", "16-mixed"} <= names and "torch.16-mixed" not in names
    assert "bfloat16" not in names, "str_to_dtype takes no torch name DTYPE_MAP does not list"
    assert "bfloat16" in installed._bridge_dtype_names(tmp_path / "absent.py")


def test_mixed_precision_names_accept_hyphens_like_bridge():
    report = validate_config(
        read_recipe(TINY, ["mixed_precision=bf16-with-mxfp8-mixed"]), installed=DEFECTIVE
    )
    assert report.ok
