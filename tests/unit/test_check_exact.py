"""``check`` says exactly what is true (issue 25): unknown is not wrong, wrong is caught with one
clear line, a pass means it was checked, and malformed input is exit 2.

The inputs are small YAMLs of our own in tests/data/check_exact, shaped like Megatron-Bridge's
diffusion and MoE examples; the fields and types come from the installed Megatron-Bridge and
megatron-core sources (the tests needing them skip without Bridge).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from harness.mx_cases import DEFECTIVE, ROOT

from mbridge_mxfp8_plugin.commands.check import run_check
from mbridge_mxfp8_plugin.errors import MXFP8ConfigError
from mbridge_mxfp8_plugin.options import PluginOptions
from mbridge_mxfp8_plugin.probes.fields import container_sections
from mbridge_mxfp8_plugin.probes.recipe_source import find_recipe

DATA = ROOT / "tests" / "data" / "check_exact"
needs_bridge = pytest.mark.skipif(container_sections() is None, reason="no Megatron-Bridge installed to read")


def _run(recipe, overrides=(), **kw):
    out, err = io.StringIO(), io.StringIO()
    kw.setdefault("installed", DEFECTIVE)
    code = run_check(str(recipe), list(overrides), out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def _rule(recipe, rule, overrides=(), **kw):
    code, out, _ = _run(recipe, overrides, as_json=True, **kw)
    (result,) = [r for r in json.loads(out)["rules"] if r["id"] == rule]
    return code, result


def _lines(out: str, prefix: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(prefix)]


# --------------------------------------------------------------------------- unknown is not wrong
@needs_bridge
def test_a_provider_outside_bridge_models_is_a_warning_not_an_error():
    code, out, _ = _run(DATA / "diffusion_like.yaml")
    assert code == 0, out
    warned = _lines(out, "warning MX101")
    assert {ln.split()[2].rstrip(":") for ln in warned} == {
        "model.crossattn_emb_size",
        "model.qkv_format",
        "dataset.global_batch_size",
        "dataset.micro_batch_size",
    }
    # The warning names the classes it tried and how to make the key checkable.
    assert all("GPTModelProvider" in ln and "--recipe" in ln for ln in warned if "model." in ln)
    assert _run(DATA / "diffusion_like.yaml", fail_on_warning=True)[0] == 1


@needs_bridge
def test_a_users_own_provider_is_not_checked_and_says_so():
    code, result = _rule(DATA / "own_provider.yaml", "MX101")
    assert code == 0
    assert result["status"] == "n/a" and "model.*" in result["note"], result
    _, out, _ = _run(DATA / "own_provider.yaml")
    assert "not checked: model.* keys not checked: _target_ acme_models.providers.AcmeModelProvider" in out


@needs_bridge
def test_a_known_class_makes_the_same_key_an_error():
    """The control: with the class known (a ``_target_``), the same kind of key is wrong."""
    target = "model._target_=megatron.bridge.models.gpt_provider.GPTModelProvider"
    code, out, _ = _run(DATA / "own_provider.yaml", [target])
    assert code == 1, out
    (line,) = _lines(out, "error MX101")
    assert "model.acme_gating is not a field of GPTModelProvider" in line
    # A fixed section (train) is an error without any _target_.
    code, out, _ = _run(DATA / "own_provider.yaml", ["+train.train_iter=3"])
    assert code == 1 and "did you mean 'train_iters'" in _lines(out, "error MX101")[0]


# --------------------------------------------------------------------------- types and values
SEEDED = [
    ("train.train_iters=ten", "train.train_iters", "an integer"),
    ("train.skip_train=yes", "train.skip_train", "a boolean"),
    ("checkpoint.save_interval=abc", "checkpoint.save_interval", "an integer"),
    ("mixed_precision.fp8_recipe=mxfp9", "mixed_precision.fp8_recipe", "did you mean 'mxfp8'"),
    ("mxfp8_plugin.verify_sample=2.0", "mxfp8_plugin.verify_sample", "a number in (0, 1]"),
    ("+model.attention_backend=flsh", "model.attention_backend", "did you mean 'flash'"),
]


@needs_bridge
@pytest.mark.parametrize(("override", "knob", "expected"), SEEDED, ids=[s[1] for s in SEEDED])
def test_seeded_type_and_value_errors_are_one_clear_line(override, knob, expected):
    clean = _run(DATA / "mp_mapping.yaml")
    assert clean[0] == 0, clean[1]
    code, out, err = _run(DATA / "mp_mapping.yaml", [override])
    assert code == 1, out
    (line,) = _lines(out, "error ")
    value = override.split("=", 1)[1]
    assert line.startswith(f"error MX102 {knob}:") and expected in line, line
    assert f"got {value}" in line.replace("'", ""), line
    assert err.count("\n") == 1 and knob in err
    code, result = _rule(DATA / "mp_mapping.yaml", "MX102", [override])
    assert code == 1 and result["status"] == "fail"
    assert [f["knob"] for f in result["findings"]] == [knob] and expected in result["findings"][0]["message"]


@needs_bridge
def test_values_the_annotations_allow_pass():
    ok = ["train.train_iters=10", "train.skip_train=true", "+model.attention_backend=flash"]
    ok += ["mixed_precision.fp8_recipe=delayed", "mxfp8_plugin.verify_sample=1.0"]
    code, out, _ = _run(DATA / "mp_mapping.yaml", ok)
    assert code == 0 and not _lines(out, "error"), out


def test_one_validator_for_every_entry_point():
    """The same value is refused, with the same words, from Python, a mapping and a recipe file."""
    from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback

    want = "mxfp8_plugin.strict must be a boolean (true/false), got 'no' (str)"
    with pytest.raises(MXFP8ConfigError) as py:
        PluginOptions(strict="no")  # type: ignore[arg-type]
    with pytest.raises(MXFP8ConfigError) as cb:
        MXFP8ParamSyncCallback(strict="no")
    with pytest.raises(MXFP8ConfigError) as mapping:
        PluginOptions.from_mapping({"strict": "no"})
    assert str(py.value) == str(cb.value) == str(mapping.value) == want
    code, out, _ = _run(DATA / "mp_mapping.yaml", ["mxfp8_plugin.strict='no'"])
    assert code == 1 and want in _lines(out, "error MX102")[0]
    with pytest.raises(MXFP8ConfigError, match=r"verify_sample must be a number in \(0, 1\], got 2.0"):
        PluginOptions(verify_sample=2.0)


# ------------------------------------------------------------------ hazards from what the job implies
@needs_bridge
def test_moe_implied_by_expert_parallelism_fires_mx014():
    code, out, _ = _run(DATA / "moe_reuse_no_overlap.yaml")
    assert code == 1, out
    (line,) = _lines(out, "error MX014")
    assert "model.expert_model_parallel_size=4" in line and "overlap_param_gather" in line
    # The control: overlapped param gather is the fix.
    fixed = ["ddp.overlap_param_gather=true", "optimizer.overlap_param_gather=true"]
    assert _rule(DATA / "moe_reuse_no_overlap.yaml", "MX014", fixed)[1]["status"] == "pass"


@needs_bridge
def test_moe_unknown_is_a_warning_and_a_dense_model_passes():
    no_experts = ["~model.expert_model_parallel_size"]
    code, result = _rule(DATA / "moe_reuse_no_overlap.yaml", "MX014", no_experts)
    assert code == 0 and result["status"] == "warn", result
    assert "cannot tell whether the model has experts" in result["findings"][0]["message"]
    dense = [*no_experts, "+model.num_moe_experts=null"]
    assert _rule(DATA / "moe_reuse_no_overlap.yaml", "MX014", dense)[1]["status"] == "pass"


@needs_bridge
def test_experts_in_the_base_recipe_fire_mx014_through_recipe():
    base = find_recipe("qwen3_30b_a3b_pretrain_config")
    if base is None or base.model.get("expert_model_parallel_size", 1) <= 1:
        pytest.skip("the installed Bridge has no Qwen3-30B-A3B recipe setting expert parallelism")
    no_experts = ["~model.expert_model_parallel_size"]
    code, out, _ = _run(
        DATA / "moe_reuse_no_overlap.yaml", no_experts, recipe_name="qwen3_30b_a3b_pretrain_config"
    )
    assert code == 1, out
    (line,) = _lines(out, "error MX014")
    assert "set by recipe qwen3_30b_a3b_pretrain_config" in line


def test_an_unknown_base_recipe_is_exit_2():
    code, _, err = _run(DATA / "mp_mapping.yaml", recipe_name="no_such_recipe_config")
    assert code == 2 and err.count("\n") == 1 and "--recipe no_such_recipe_config" in err


# --------------------------------------------------------------------------- pass means checked
def test_a_pass_vouches_only_for_what_was_checked():
    """A partial file leaves reuse, FSDP, offload... to the base recipe: those rules are n/a
    with the reason, and --fail-on-unchecked makes them exit 1."""
    path = DATA / "diffusion_like.yaml"
    code, out, _ = _run(path, as_json=True)
    rules = {r["id"]: r for r in json.loads(out)["rules"]}
    for rule in ("MX002", "MX004", "MX007", "MX012", "MX016"):
        assert rules[rule]["status"] == "n/a", rules[rule]
        assert "not set in this recipe" in rules[rule]["note"] or "base config" in rules[rule]["note"]
    assert code == 0
    code, _, err = _run(path, fail_on_unchecked=True)
    assert code == 1 and "unchecked MX" in err


def test_mx103_does_not_pass_a_name_it_could_not_look_up(monkeypatch):
    import mbridge_mxfp8_plugin.config.sections as sections

    monkeypatch.setattr(sections, "bridge_facts", lambda: None)
    code, result = _rule(DATA / "moe_reuse_no_overlap.yaml", "MX103")
    assert result["status"] == "n/a" and "not looked up" in result["note"], result


# ------------------------------------------------------------------ malformed input, renamed sections
@pytest.mark.parametrize("override", ["=", "=5", "a..b=1", "train.train_iters"])
def test_a_malformed_override_is_exit_2_in_one_line(override):
    env = {**os.environ, "NO_VCS_VERSION": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mbridge_mxfp8_plugin.commands.cli",
            "check",
            str(DATA / "mp_mapping.yaml"),
            override,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "is not an override" in proc.stderr
    code, _, err = _run(DATA / "mp_mapping.yaml", [override])  # the library entry point agrees
    assert code == 2 and "is not an override" in err


def test_every_renamed_config_section_gets_the_same_advice():
    code, out, _ = _run(DATA / "renamed_sections.yaml")
    assert code == 1
    lines = _lines(out, "error MX101")
    assert len(lines) == 3
    for old, new in (
        ("model_config", "model"),
        ("train_config", "train"),
        ("checkpoint_config", "checkpoint"),
    ):
        (line,) = [ln for ln in lines if f" {old}:" in ln]
        assert f"Rename it to {new}" in line and "'_config' suffix" in line, line
    assert "# rename section model_config: to model:" in out
