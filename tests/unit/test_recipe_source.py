"""What a Megatron-Bridge recipe function sets, read from its source (probes/recipe_source.py):
``check --recipe module:function`` reads the user's own file, and a name without Bridge says so."""

from __future__ import annotations

from harness.check_io import run as _run
from harness.mx_cases import TINY


def test_recipe_given_as_module_function_is_read_from_the_users_file(tmp_path, monkeypatch):
    """``--recipe my_recipe:my_cfg``, the launcher's form, and a file path form."""
    (tmp_path / "my_recipe.py").write_text(
        "from megatron.bridge.models.gpt_provider import GPTModelProvider\n\n"
        "def my_cfg():\n"
        "    cfg = make()\n"
        "    cfg.model = GPTModelProvider(num_layers=2)\n"
        "    cfg.model.num_moe_experts = 8\n"
        "    return cfg\n"
    )
    monkeypatch.chdir(tmp_path)
    from mbridge_mxfp8_plugin.probes.recipe_source import find_recipe

    for spec in ("my_recipe:my_cfg", f"{tmp_path / 'my_recipe.py'}:my_cfg"):
        found = find_recipe(spec)
        assert found is not None and found.name == "my_cfg", spec
        assert found.provider == "megatron.bridge.models.gpt_provider.GPTModelProvider"
        assert found.model == {"num_moe_experts": 8}
    code, out, err = _run(TINY, recipe_name="my_recipe:nope")
    assert code == 2 and "no function 'nope' found in 'my_recipe'" in err, out + err


def test_recipe_name_without_bridge_says_bridge_is_missing(monkeypatch):
    from mbridge_mxfp8_plugin.probes import _source, recipe_source

    monkeypatch.setattr(_source, "_megatron_roots", lambda: [])
    recipe_source.find_recipe.cache_clear()
    try:
        code, out, err = _run(TINY, recipe_name="llama3_8b_pretrain_config")
    finally:
        recipe_source.find_recipe.cache_clear()
    assert code == 2, out + err
    assert "Megatron-Bridge is not installed" in err and "module:function" in err


_HELPERS = """
from megatron.bridge.training.comm_overlap import CommOverlapConfig
from my_base import base_with_overlap


def _common():
    return make(comm_overlap=None)


def no_overlap():
    cfg = _common()
    return cfg


def own_overlap():
    cfg = _common()
    cfg.comm_overlap = CommOverlapConfig(
        tp_comm_overlap=False, overlap_param_gather_with_optimizer_step=False
    )
    return cfg


def imported_overlap():
    return base_with_overlap()


def opaque():
    return somewhere_else()
"""


def test_whether_a_recipe_sets_comm_overlap_is_read_through_its_helpers(tmp_path, monkeypatch):
    """comm_overlap overwrites the overlap knobs inside pretrain(), so check must know whether
    the recipe sets one: its own last word, a helper in its module, a helper it imports, or
    nothing said (then unstated, never guessed)."""
    (tmp_path / "my_recipes.py").write_text(_HELPERS)
    (tmp_path / "my_base.py").write_text(
        "def base_with_overlap():\n"
        "    return make(comm_overlap=CommOverlapConfig(**extra, bucket_size=None))\n"
    )
    monkeypatch.chdir(tmp_path)
    from mbridge_mxfp8_plugin.probes.recipe_source import SPLAT, UNSTATED, find_recipe

    find_recipe.cache_clear()
    try:
        found = {
            n: find_recipe(f"my_recipes:{n}")
            for n in ("no_overlap", "own_overlap", "imported_overlap", "opaque")
        }
    finally:
        find_recipe.cache_clear()
    assert found["no_overlap"].comm_overlap is None
    assert found["own_overlap"].comm_overlap == {
        "tp_comm_overlap": False,
        "overlap_param_gather_with_optimizer_step": False,
    }
    assert found["imported_overlap"].comm_overlap == {SPLAT: True, "bucket_size": None}
    assert found["opaque"].comm_overlap == UNSTATED


def test_a_knob_the_recipes_comm_overlap_overwrites_is_judged_at_its_overwritten_value(tmp_path, monkeypatch):
    """The launcher's dry run said "would start" where check said MX007 error on the same inputs:
    check did not know that the recipe's comm_overlap overwrites the stated true. Given the
    recipe, check judges the value the job runs with and warns that the written one is lost."""
    (tmp_path / "my_recipes.py").write_text(_HELPERS)
    monkeypatch.chdir(tmp_path)
    override = ["optimizer.overlap_param_gather_with_optimizer_step=true"]
    code, out, err = _run(TINY, override)
    assert code == 1 and "error MX007" in out, out + err  # no recipe: the file is the whole config
    code, out, err = _run(TINY, override, recipe_name="my_recipes:no_overlap")
    assert code == 1 and "error MX007" in out, out + err  # comm_overlap=None: the true stands
    code, out, err = _run(TINY, override, recipe_name="my_recipes:own_overlap")
    assert code == 0 and "error MX007" not in out, out + err
    (warning,) = [
        ln
        for ln in out.splitlines()
        if ln.startswith("warning MX005 optimizer.overlap_param_gather_with_optimizer_step")
    ]
    assert "overlap_param_gather_with_optimizer_step=true is overwritten by comm_overlap" in warning
    assert "so the job runs with false" in warning, warning
