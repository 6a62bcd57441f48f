"""``apply_recipe`` merges a recipe onto a ``ConfigContainer`` with Megatron-Bridge's own
``omegaconf_utils`` (the installed wheel), so a file means to the plugin what it means to Bridge.

Single process, no training. The container is Bridge's shape (nested dataclasses, ``mixed_precision``
a name) with megatron-core's real ddp/optimizer configs: building a real ``ConfigContainer`` imports
all of Bridge's training config (a minute here) and adds nothing to what is merged. Bridge's
package import reaches Transformer Engine, which cannot be installed on this host: served by
``harness.te_stub`` to the importers that need it, as in the rest of this tier.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import warnings
from typing import Any

import pytest
import torch
from harness.mx_cases import DEFECTIVE, TINY
from harness.te_stub import importer_scoped_stubs

from mbridge_mxfp8_plugin.adapters.recipes import PluginOptions, RecipeError, apply_recipe, read_recipe
from mbridge_mxfp8_plugin.config.read import merge_onto_container
from mbridge_mxfp8_plugin.errors import MXFP8ConfigError


@pytest.fixture(scope="module")
def ou() -> Any:
    """Bridge's ``training.utils.omegaconf_utils``, the module ``apply_recipe`` calls."""
    try:
        with importer_scoped_stubs():
            return importlib.import_module("megatron.bridge.training.utils.omegaconf_utils")
    except ImportError as exc:
        if os.environ.get("MXFP8_REAL_BRIDGE") == "require":
            raise
        pytest.skip(f"Megatron-Bridge is not importable here ({exc})")


# Stand-ins for the container's sections, alike in shape on purpose (duplicates lists them, and
# test_config_equivalence's): each holds only the fields and defaults the merge here reads.
@dataclasses.dataclass
class _Model:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 2
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    seq_length: int = 128
    params_dtype: torch.dtype = torch.float32


@dataclasses.dataclass
class _Train:
    train_iters: int = 1
    eval_interval: int = 1
    eval_iters: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1


def _container() -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp_cfg, opt_cfg = DistributedDataParallelConfig(), OptimizerConfig(lr=1.0)

    @dataclasses.dataclass
    class Container:
        model: _Model = dataclasses.field(default_factory=_Model)
        train: _Train = dataclasses.field(default_factory=_Train)
        ddp: Any = dataclasses.field(default_factory=lambda: ddp_cfg)
        optimizer: Any = dataclasses.field(default_factory=lambda: opt_cfg)
        mixed_precision: Any = "bf16_mixed"
        data_parallel_size: int | None = None

    return Container()


#: ``check_for_nan_in_grad`` is in the container, not in the file: a plain override (no ``+``)
#: sets it under Bridge's struct mode, as it does here.
OVERRIDES = ["model.params_dtype=torch.bfloat16", "ddp.check_for_nan_in_grad=true", "train.eval_iters=5"]


def test_apply_recipe_gives_the_container_bridges_own_merge_gives(ou):
    ours, bridges = _container(), _container()
    options = apply_recipe(ours, TINY, OVERRIDES, installed=DEFECTIVE)
    ou.process_config_with_overrides(bridges, str(TINY), list(OVERRIDES))  # skips mxfp8_plugin (a warning)
    assert dataclasses.asdict(ours) == dataclasses.asdict(bridges)
    # values from the file and the overrides, as written there
    assert options == PluginOptions(dp_size=2)
    assert ours.mixed_precision == "bf16_with_mxfp8_mixed" and ours.model.hidden_size == 45
    assert ours.model.params_dtype is torch.bfloat16 and ours.ddp.check_for_nan_in_grad is True
    assert ours.optimizer.lr == 0.03 and ours.train.eval_iters == 5
    assert ours.ddp.overlap_param_gather and ours.ddp.reuse_grad_buf_for_mxfp8_param_ag


def test_interpolation_into_the_recipe_resolves_from_the_container(ou, tmp_path):
    """The base recipe decides ``${model.num_layers}``: only where it is present (here) is the value known."""
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  eval_iters: ${model.num_layers}\n")
    cfg = _container()
    apply_recipe(cfg, path, installed=DEFECTIVE)
    assert cfg.train.eval_iters == _Model().num_layers
    with pytest.raises(RecipeError, match="which only the base recipe decides"):
        read_recipe(path)  # the file alone (check's view) cannot say


def test_a_key_the_recipe_lacks_needs_plus_as_under_bridge(ou):
    """Struct mode, as Bridge's ``parse_hydra_overrides`` (``apply_recipe``'s file check refuses this
    one earlier still: the reader's own verdict is tested here)."""
    with pytest.raises(RecipeError, match=r"override 'ddp\.no_such_knob=1': Could not override"):
        merge_onto_container(_container(), [TINY], ["ddp.no_such_knob=1"])
    with pytest.raises(ou.OverridesError):  # Bridge's own verdict on the same override
        ou.process_config_with_overrides(_container(), str(TINY), ["ddp.no_such_knob=1"])


def test_apply_recipe_refuses_before_touching_the_container(ou):
    cfg = _container()
    with pytest.raises(MXFP8ConfigError, match="MX101 ddp.overlap_param_gathr"):
        apply_recipe(cfg, TINY, ["+ddp.overlap_param_gathr=true"], installed=DEFECTIVE)
    assert cfg.mixed_precision == "bf16_mixed" and not cfg.ddp.overlap_param_gather


def test_apply_recipe_strict_and_lenient(ou):
    with pytest.raises(MXFP8ConfigError, match="MX006 ddp.overlap_grad_reduce"):
        apply_recipe(_container(), TINY, ["ddp.overlap_grad_reduce=false"], installed=DEFECTIVE)
    cfg = _container()
    opts = apply_recipe(
        cfg, TINY, ["ddp.overlap_grad_reduce=false", "mxfp8_plugin.strict=false"], installed=DEFECTIVE
    )
    assert not opts.strict and cfg.ddp.overlap_grad_reduce is False  # logged, not raised


@pytest.mark.parametrize("plugin", [False, True], ids=["bridge-alone", "apply_recipe"])
def test_what_bridge_would_skip_silently_is_refused(ou, tmp_path, plugin):
    """Bridge's ``apply_overrides`` skips a key its container lacks (a WARNING its own log filter
    hides) and sets a mapping over a recipe name as is: the job runs without the knob."""
    typo = ["+model.seq_lenght=4"]
    path = tmp_path / "mp.yaml"
    path.write_text("mixed_precision:\n  fp8_recipe: mxfp8\n")
    if not plugin:
        cfg = ou.process_config_with_overrides(_container(), str(TINY), typo)
        assert not hasattr(cfg.model, "seq_lenght") and cfg.model.seq_length == 32  # silently dropped
        cfg = ou.process_config_with_overrides(_container(), str(path))
        assert cfg.mixed_precision == {"fp8_recipe": "mxfp8"}  # no longer a recipe name
        return
    cfg = _container()
    with pytest.raises(MXFP8ConfigError, match=r"model\.seq_lenght.*seq_length"):
        apply_recipe(cfg, TINY, typo, installed=DEFECTIVE)
    with pytest.raises(MXFP8ConfigError, match="a name, not a section"):
        apply_recipe(cfg, path, installed=DEFECTIVE)
    assert cfg.mixed_precision == "bf16_mixed"  # refused before anything was set
