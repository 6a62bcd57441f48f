"""The plugin's options (options.py): one dataclass behind every entry point, strict about what it
takes, and each knob reaching ``check`` and the launcher under its YAML name."""

from __future__ import annotations

import dataclasses

import pytest
from harness.check_io import EXACT as DATA
from harness.check_io import lines as _lines
from harness.check_io import run as _run

from mbridge_mxfp8_plugin import MXFP8ParamSyncCallback
from mbridge_mxfp8_plugin.errors import MXFP8ConfigError
from mbridge_mxfp8_plugin.options import PluginOptions


def test_plugin_options_are_strict():
    with pytest.raises(MXFP8ConfigError, match="prestge.*did you mean 'prestage'"):
        PluginOptions.from_mapping({"prestge": False})
    with pytest.raises(MXFP8ConfigError, match="enabled must be a boolean"):
        PluginOptions.from_mapping({"enabled": "false"})


def test_one_options_type_for_every_entry_point():
    """PluginOptions is the schema of the YAML section and the callbacks' options; keywords
    still work and win over ``options``."""

    from mbridge_mxfp8_plugin.options import option_types as plugin_fields

    names = {f.name for f in dataclasses.fields(PluginOptions)}
    assert set(plugin_fields()) == names
    cb = MXFP8ParamSyncCallback(PluginOptions(prestage=False, strict=False), strict=True)
    assert (cb.options.prestage, cb.options.strict) == (False, True)
    assert MXFP8ParamSyncCallback(guard_exit_saves=False).options.guard_exit_saves is False


def test_verify_weights_is_an_option_of_every_entry_point(tmp_path):
    """The knob is off by default, typed, and reaches check and the launcher under its YAML name."""
    import io

    from harness.mx_cases import DEFECTIVE, TINY

    from mbridge_mxfp8_plugin import MXFP8ConfigError
    from mbridge_mxfp8_plugin.commands.check import run_check
    from mbridge_mxfp8_plugin.commands.launch import plugin_options

    assert PluginOptions().verify_weights is False
    assert PluginOptions.from_mapping({"verify_weights": True}).verify_weights is True
    with pytest.raises(MXFP8ConfigError, match="verify_weights must be"):
        PluginOptions.from_mapping({"verify_weights": "yes please"})
    # The launcher reads the section and its overrides into the options the callback gets.
    assert plugin_options(None, ["mxfp8_plugin.verify_weights=true"]).verify_weights is True
    recipe = tmp_path / "r.yaml"
    recipe.write_text("mxfp8_plugin:\n  verify_weights: true\n")
    assert plugin_options(recipe, []).verify_weights is True
    with pytest.raises(MXFP8ConfigError, match="verify_weights must be"):
        plugin_options(None, ["mxfp8_plugin.verify_weights=3"])
    # check accepts it (a typo of it is refused: the control).
    for key, ok in (("verify_weights", True), ("verify_weight", False)):
        out, err = io.StringIO(), io.StringIO()
        code = run_check(str(TINY), [f"mxfp8_plugin.{key}=true"], out=out, err=err, installed=DEFECTIVE)
        assert (code == 0) == ok, out.getvalue() + err.getvalue()


def test_verify_sample_is_a_checked_fraction(tmp_path):
    """The sampling knob: a number in (0, 1], from Python, YAML and overrides alike."""
    from mbridge_mxfp8_plugin import MXFP8ConfigError
    from mbridge_mxfp8_plugin.commands.launch import plugin_options

    assert 0 < PluginOptions().verify_sample < 1  # sampled by default
    assert PluginOptions.from_mapping({"verify_sample": 1}).verify_sample == 1
    assert plugin_options(None, ["mxfp8_plugin.verify_sample=0.5"]).verify_sample == 0.5
    for bad in (0, 0.0, 1.5, -0.1):
        with pytest.raises(MXFP8ConfigError, match=r"verify_sample must be a number in \(0, 1\]"):
            PluginOptions.from_mapping({"verify_sample": bad})
    with pytest.raises(MXFP8ConfigError, match="verify_sample must be a number"):
        PluginOptions.from_mapping({"verify_sample": "all"})
    with pytest.raises(MXFP8ConfigError, match="verify_sample"):
        plugin_options(None, ["mxfp8_plugin.verify_sample=2"])


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


def test_a_misspelt_keyword_names_the_option_it_was_meant_to_be():
    """``PluginOptions(verify_weight=True)`` was the dataclass's bare TypeError; now the same one
    line as a misspelt YAML key (still a TypeError, for callers that catch that)."""
    from mbridge_mxfp8_plugin.errors import MXFP8UsageError
    from mbridge_mxfp8_plugin.options import PluginOptions

    for make in (
        lambda: PluginOptions(verify_weight=True),
        lambda: PluginOptions().replace(verify_weight=True),
    ):
        with pytest.raises(
            MXFP8UsageError, match=r"verify_weight \(did you mean 'verify_weights'\?\)"
        ) as err:
            make()
        assert isinstance(err.value, TypeError)
