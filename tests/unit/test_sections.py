"""Reading a recipe section by section (config/sections.py): every key checked against the class
Bridge builds the section as (MX101), the plugin's own section against the options; a key of a
section whose class the base recipe decides is a warning, not an error."""

from __future__ import annotations

import json

import pytest
from harness.check_io import needs_bridge
from harness.check_io import run as _run
from harness.mx_cases import DEFECTIVE, TINY

from mbridge_mxfp8_plugin.adapters.recipes import read_recipe
from mbridge_mxfp8_plugin.config.validate import validate_config


@needs_bridge
@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("+train.train_iter=2", "train_iters"),
        ("+checkpoint.sav=/tmp/ckpt", "save"),
        ("+scheduler.lr_warmup_iter=10", "lr_warmup_iters"),
        ("+ddp.overlap_param_gathr=true", "overlap_param_gather"),
    ],
)
def test_typo_in_any_bridge_section_fails_mx101(override, meant):
    """Every section whose class is fixed (one concrete class in ConfigContainer) is key-checked
    against the installed Bridge's class (``train.train_iter=2`` passed MX101 once and failed
    later inside the job)."""
    key = override.lstrip("+").split("=")[0]
    code, out, _ = _run(TINY, [override])
    assert code == 1, out
    assert f"error MX101 {key}:" in out and f"did you mean {meant!r}" in out
    code, out, _ = _run(TINY, [override], as_json=True)
    payload = json.loads(out)
    (mx101,) = [r for r in payload["rules"] if r["id"] == "MX101"]
    assert code == 1 and mx101["status"] == "fail"
    assert [f["knob"] for f in mx101["findings"]] == [key]


@needs_bridge
def test_correct_keys_of_those_sections_pass():
    overrides = ["train.train_iters=2", "+checkpoint.save=/tmp/ckpt", "scheduler.lr_warmup_iters=10"]
    code, out, _ = _run(TINY, overrides)
    assert code == 0, out


@needs_bridge
@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("train.train_iter=2", "has no field 'train_iter' (did you mean 'train_iters'?)"),
        ("+scheduler.lr_warmup_iters=10", "scheduler.lr_warmup_iters is already a field of"),
        ("+ddp.use_megatron_fsdp=true", "ddp.use_megatron_fsdp is already a field of"),
    ],
)
def test_an_override_bridges_hydra_parse_refuses_is_unreadable_input(override, why):
    """Bridge applies overrides with Hydra onto the container, which holds every field of a fixed
    section's class: a key without ``+`` that is no field, or a ``+`` on a field that holds a value
    (not None), is refused there ("Could not override", "Could not append"; tested against
    Bridge's own parse in tests/bridge_real/test_launch_report.py), so check exits 2 as the
    launcher does, naming the fix; ``+`` on a field that holds None is accepted."""
    code, out, err = _run(TINY, [override])
    assert code == 2 and err.count("error: ") == 1 and why in err, out + err
    assert _run(TINY, ["+ddp.bucket_size=1000"])[0] == 0  # bucket_size defaults to None


@needs_bridge
@pytest.mark.parametrize("section, key", [("model", "hiden_size"), ("dataset", "seq_lenght_typo")])
def test_a_key_of_a_section_whose_class_is_open_is_a_warning(section, key):
    """``model`` and ``dataset`` are unions in ConfigContainer (``dataset`` includes the abstract
    DatasetProvider): the base recipe picks the class, maybe one outside Bridge, so a key that is
    not a field of the classes check can see is unknown, not wrong: a warning naming the classes
    tried and how to make it checkable; MX101 is then ``warn``, never ``pass``."""
    override = [f"+{section}.{key}=3"]
    code, out, _ = _run(TINY, override)
    assert code == 0, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("warning MX101")]
    assert f"{section}.{key}" in line and "Provider" in line and "--recipe" in line, line
    _, js, _ = _run(TINY, override, as_json=True)
    (mx101,) = [r for r in json.loads(js)["rules"] if r["id"] == "MX101"]
    assert mx101["status"] == "warn" and mx101["findings"][0]["severity"] == "warning"
    assert _run(TINY, override, fail_on_warning=True)[0] == 1


def test_typo_in_the_plugin_section_is_the_plugins_own_refusal():
    code, out, _ = _run(TINY, ["+mxfp8_plugin.prestge=false"])
    assert code == 1
    (line,) = [ln for ln in out.splitlines() if ln.startswith("error MX101")]
    assert "did you mean 'prestage'" in line and "the plugin refuses" in line
    assert "Megatron-Bridge" not in line


def test_plugin_section_is_checked():
    report = validate_config(
        read_recipe(TINY, ["+mxfp8_plugin.prestge=false", "mxfp8_plugin.strict=1"]),
        strict=False,
        installed=DEFECTIVE,
    )
    assert {(f.rule, f.knob) for f in report.errors} == {
        ("MX101", "mxfp8_plugin.prestge"),
        ("MX102", "mxfp8_plugin.strict"),
    }
