"""adapters/recipes.py: loading, overrides, callbacks (applying onto a ConfigContainer needs Bridge's
own omegaconf_utils: tests/bridge_real/test_apply_recipe.py). The hard-coded Bridge facts checked
against the installed Bridge wheel: tests/unit/test_bridge_facts.py."""

from __future__ import annotations

import re

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
from mbridge_mxfp8_plugin.probes.bridge_facts import (
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
