"""``check`` says why the plugin stays passive where Megatron-FSDP or the LayerWise optimizer owns
the param sync, and the file probe agrees with megatron-core's real classes.

The recipe is the shipped tiny MXFP8 recipe with the plugin switched off on a release with defects
(A, B1, C): MX009 is an error there, because the DDP path needs the plugin. A job whose param sync
Megatron-FSDP or the LayerWise optimizer owns does not take that path: MX009 passes and names the
owner, whichever way the config states it.
"""

from __future__ import annotations

import pytest
from harness.mx_cases import DEFECTIVE, TINY

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import validate_config
from mbridge_mxfp8_plugin.probes.owners import fsdp_classes, layer_wise_classes, probe_owner_files

OFF = "mxfp8_plugin.enabled=false"


def test_plugin_off_on_the_ddp_path_is_an_error() -> None:
    """The baseline the owner cases differ from: same recipe, no owner, MX009 fails."""
    report = validate_config(read_recipe(TINY, [OFF]), strict=False, installed=DEFECTIVE)
    assert report.by_rule("MX009").status == "fail"


@pytest.mark.parametrize(
    ("override", "owner", "knob"),
    [
        ("+dist.use_megatron_fsdp=true", "Megatron-FSDP", "dist.use_megatron_fsdp"),
        ("+ddp.use_megatron_fsdp=true", "Megatron-FSDP", "ddp.use_megatron_fsdp"),
        ("optimizer.optimizer=dist_muon", "the LayerWise distributed optimizer", "optimizer.optimizer"),
    ],
    ids=["fsdp-dist", "fsdp-ddp", "dist_muon"],
)
def test_mx009_names_the_owner(override: str, owner: str, knob: str) -> None:
    report = validate_config(read_recipe(TINY, [OFF, override]), strict=False, installed=DEFECTIVE)
    result = report.by_rule("MX009")
    assert result.status == "pass", result
    assert result.note.startswith(f"the plugin stays passive: {owner} owns the param sync"), result.note
    assert result.knob == knob


def test_layer_wise_flag_where_the_release_has_it() -> None:
    """``use_layer_wise_distributed_optimizer`` (OptimizerConfig, core >= 0.18) names the owner;
    on a release without the field the key itself is the problem (MX101), not the plugin."""
    from megatron.core.optimizer import OptimizerConfig

    flag = "use_layer_wise_distributed_optimizer"
    report = validate_config(
        read_recipe(TINY, [OFF, f"+optimizer.{flag}=true"]), strict=False, installed=DEFECTIVE
    )
    if flag in OptimizerConfig.__dataclass_fields__:
        result = report.by_rule("MX009")
        assert result.status == "pass" and result.knob == f"optimizer.{flag}", result
        assert "the LayerWise distributed optimizer owns the param sync" in result.note
    else:
        assert any(f.knob == f"optimizer.{flag}" for f in report.by_rule("MX101").findings)


def test_owner_files_agree_with_the_imported_classes() -> None:
    """``doctor`` reads the files; the runtime gate imports the classes: same answer per release."""
    files = probe_owner_files()
    assert files is not None
    assert files.layer_wise == bool(layer_wise_classes())
    wrappers = [c for c in fsdp_classes() if c.__name__.startswith("FullyShardedDataParallel")]
    assert files.megatron_fsdp == bool(wrappers)
    assert files.layer_wise or not files.layer_wise_on_ddp_buffers


def test_gate_sees_through_wrappers_and_nested_chains() -> None:
    """NeMo's wrappers forward ``ddp_config`` from the module they wrap (not in their own
    ``__dict__``); a LayerWise optimizer may sit in a chain inside a chain. A plain DDP-like chunk
    and an optimizer without LayerWise are nobody's (the DDP path the plugin fixes)."""
    from types import SimpleNamespace

    import torch

    from mbridge_mxfp8_plugin.probes.owners import model_sync_owner, optimizer_sync_owner

    class Forwarding(torch.nn.Module):
        def __init__(self, fsdp: bool) -> None:
            super().__init__()
            self.fsdp = fsdp

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            if name == "ddp_config":
                return SimpleNamespace(use_megatron_fsdp=self.fsdp)
            return super().__getattr__(name)

    owner = model_sync_owner([Forwarding(True)])
    assert owner is not None and owner.owner == "Megatron-FSDP"
    assert model_sync_owner([Forwarding(False)]) is None
    (layer_wise_cls,) = layer_wise_classes() or (None,)
    if layer_wise_cls is None:
        assert optimizer_sync_owner(SimpleNamespace(chained_optimizers=[])) is None
        return
    nested = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(chained_optimizers=[layer_wise_cls.__new__(layer_wise_cls)])]
    )
    found = optimizer_sync_owner(nested)
    assert found is not None and found.found.endswith("LayerWiseDistributedOptimizer")
    assert optimizer_sync_owner(SimpleNamespace(chained_optimizers=[SimpleNamespace()])) is None
