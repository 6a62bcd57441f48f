"""recipes.py: loading, overrides, callbacks (applying onto a ConfigContainer needs Bridge's own
omegaconf_utils: tests/bridge_real/test_apply_recipe.py); and the hard-coded Bridge facts in
probes/bridge_facts.py checked against the installed Bridge wheel."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from harness.mx_cases import RECIPES, TINY

from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
from mbridge_mxfp8_plugin.adapters.recipes import (
    PluginOptions,
    RecipeError,
    callbacks_from_recipe,
    load_recipe,
    read_recipe,
)
from mbridge_mxfp8_plugin.errors import MXFP8ConfigError
from mbridge_mxfp8_plugin.probes.bridge_facts import (
    CONFIG_SECTIONS,
    MIXED_PRECISION_FIELDS,
    MIXED_PRECISION_RECIPES,
    PLUGIN_SECTION,
)


def test_load_recipe_strips_the_plugin_section():
    bridge, options = load_recipe(TINY)
    assert PLUGIN_SECTION not in bridge
    assert bridge["mixed_precision"] == "bf16_with_mxfp8_mixed"
    assert options == PluginOptions(dp_size=2)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_states_the_mxfp8_knobs(recipe):
    bridge, options = load_recipe(recipe)
    assert options.enabled and options.strict and options.repair_alignment
    assert bridge["mixed_precision"] == "bf16_with_mxfp8_mixed"
    for section in ("ddp", "optimizer"):
        assert bridge[section]["use_distributed_optimizer"] is True
        assert bridge[section]["overlap_param_gather"] is True
        assert bridge[section]["reuse_grad_buf_for_mxfp8_param_ag"] is True
    assert bridge["ddp"]["overlap_grad_reduce"] is True


def test_overrides_follow_hydra_syntax():
    """Hydra's grammar, as Bridge parses ``key=value`` arguments: numbers as Hydra types them
    (``4e7`` is a float), quoted text stays a string, ``+`` adds, ``~`` deletes, lists."""
    data = read_recipe(
        TINY,
        [
            "ddp.bucket_size=4e7",
            "optimizer.lr=3e-4",
            "~optimizer.weight_decay",
            "+dist.use_megatron_fsdp=false",
            "+model.pipeline_dtype='true'",
            "+train.profile_ranks=[0,1]",
            "mixed_precision=null",
        ],
    )
    assert data["ddp"]["bucket_size"] == 4e7 and isinstance(data["ddp"]["bucket_size"], float)
    assert data["optimizer"]["lr"] == 0.0003 and "weight_decay" not in data["optimizer"]
    assert data["dist"] == {"use_megatron_fsdp": False}
    assert data["model"]["pipeline_dtype"] == "true"
    assert data["train"]["profile_ranks"] == [0, 1] and data["mixed_precision"] is None
    assert read_recipe(TINY)["ddp"]["bucket_size"] is None, "overrides must not leak into the file's data"


@pytest.mark.parametrize(
    "override, match",
    [
        ("ddp.bucket_size", "Error parsing override"),
        ("mixed_precision.fp8=e4m3", "mixed_precision is 'bf16_with_mxfp8_mixed', not a section"),
        ("ddp.x=[1,", "no viable alternative at input '[1,'"),
        ("=1", "override '=1': no key; expected dotted.key=value"),  # Hydra: the empty key
        ("~", "override '~': no key"),
        ("ddp..x=1", "not an override in Hydra's grammar"),
        (
            "+ddp.overlap_param_gather=false",
            "Could not append to config. An item is already at 'ddp.overlap_param_gather'",
        ),
    ],
)
def test_bad_overrides_are_recipe_errors(override, match):
    with pytest.raises(RecipeError, match=re.escape(match)):
        read_recipe(TINY, [override])


def test_interpolations_resolve_in_the_file_and_refuse_the_base(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  eval_interval: 3\ncheckpoint:\n  save_interval: ${train.eval_interval}\n")
    assert read_recipe(path)["checkpoint"]["save_interval"] == 3
    path.write_text("dataset:\n  sequence_length: ${model.seq_length}\n")
    with pytest.raises(
        RecipeError, match=r"sequence_length is \$\{model.seq_length\}, which only the base recipe decides"
    ):
        read_recipe(path)


def test_plugin_options_are_strict():
    with pytest.raises(MXFP8ConfigError, match="prestge.*did you mean 'prestage'"):
        PluginOptions.from_mapping({"prestge": False})
    with pytest.raises(MXFP8ConfigError, match="enabled must be a boolean"):
        PluginOptions.from_mapping({"enabled": "false"})


def test_callbacks_from_recipe():
    (cb,) = callbacks_from_recipe(
        TINY,
        [
            "mxfp8_plugin.prestage=false",
            "mxfp8_plugin.guard_exit_saves=false",
            "mxfp8_plugin.validate=false",
        ],
    )
    assert isinstance(cb, MXFP8ParamSyncCallback)
    opts = cb.options
    assert (opts.prestage, opts.repair_alignment, opts.refresh_at_train_end) == (False, True, True)
    assert (opts.guard_exit_saves, opts.validate) == (False, False), "YAML reaches every callback option"
    assert callbacks_from_recipe(PluginOptions(enabled=False)) == []


def test_one_options_type_for_every_entry_point():
    """PluginOptions is the schema of the YAML section and the callbacks' options; keywords
    still work and win over ``options``."""

    from mbridge_mxfp8_plugin.options import option_types as plugin_fields

    names = {f.name for f in dataclasses.fields(PluginOptions)}
    assert set(plugin_fields()) == names
    cb = MXFP8ParamSyncCallback(PluginOptions(prestage=False, strict=False), strict=True)
    assert (cb.options.prestage, cb.options.strict) == (False, True)
    assert MXFP8ParamSyncCallback(guard_exit_saves=False).options.guard_exit_saves is False


def test_tiny_recipe_matches_the_cpu_demo_toy():
    from harness.bridge_loop import LoopSchedule

    from mbridge_mxfp8_plugin.testing.toy import ToyConfig

    bridge, options = load_recipe(TINY)
    toy, sched = ToyConfig(), LoopSchedule()
    ddp, opt = bridge["ddp"], bridge["optimizer"]
    assert (ddp["overlap_param_gather"], ddp["overlap_grad_reduce"]) == (
        toy.overlap_param_gather,
        toy.overlap_grad_reduce,
    )
    assert (ddp["grad_reduce_in_fp32"], ddp["align_param_gather"]) == (
        toy.grad_reduce_in_fp32,
        toy.align_param_gather,
    )
    assert ddp["bucket_size"] == toy.bucket_size and opt["lr"] == toy.lr
    assert (
        bridge["model"]["hidden_size"] == toy.dims[1]
        and bridge["train"]["micro_batch_size"] == toy.micro_batch_size
    )
    t = bridge["train"]
    assert (t["train_iters"], t["eval_interval"], t["eval_iters"]) == (
        sched.train_iters,
        sched.eval_interval,
        sched.eval_iters,
    )
    assert options.dp_size == 2  # the demo's world size


# --------------------------------------------------------------------------- _schema vs the installed Bridge
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
