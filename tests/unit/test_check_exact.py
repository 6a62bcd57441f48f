"""``check`` says exactly what is true (issue 25): unknown is not wrong, wrong is caught with one
clear line, a pass means it was checked, and malformed input is exit 2.

The inputs are small YAMLs of our own in tests/data/check_exact, shaped like Megatron-Bridge's
diffusion and MoE examples; the fields and types come from the installed Megatron-Bridge and
megatron-core sources (the tests needing them skip without Bridge).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness.check_io import EXACT as DATA
from harness.check_io import lines as _lines
from harness.check_io import needs_bridge
from harness.check_io import rule as _rule
from harness.check_io import run as _run
from harness.mx_cases import ROOT

from mbridge_mxfp8_plugin.probes.recipe_source import find_recipe


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
def test_an_expert_knob_alone_is_not_proof_of_moe():
    """``moe_router_topk`` is set by every GPT provider, dense ones too: without num_moe_experts
    (or expert parallelism) MX014 cannot tell, so it warns naming the knob; it used to be an
    error calling the model MoE. With num_moe_experts stated the verdict follows it."""
    code, result = _rule(DATA / "expert_knob_only.yaml", "MX014")
    assert code == 0 and result["status"] == "warn", result
    message = result["findings"][0]["message"]
    assert "cannot tell whether the model has experts" in message and "moe_router_topk" in message
    code, result = _rule(DATA / "expert_knob_only.yaml", "MX014", ["+model.num_moe_experts=8"])
    assert code == 1 and result["status"] == "fail", result
    dense = _rule(DATA / "expert_knob_only.yaml", "MX014", ["+model.num_moe_experts=null"])[1]
    assert dense["status"] == "pass", dense


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
