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
