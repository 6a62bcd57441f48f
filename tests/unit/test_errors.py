"""The plugin's exceptions (errors.py): the classes a caller catches, and what each also is.

docs/verify.md and docs/robustness.md tell users which error a refusal raises; callers that
predate the plugin catch the builtin kinds (a bad knob value is a ``ValueError``, a wrong object a
``TypeError``), so each plugin error must stay both its own class and that builtin, and every one
of them an :class:`MXFP8PluginError` (one ``except`` for all of them). The refusals below are raised
by the plugin's own entry points, not constructed here.
"""

from __future__ import annotations

import pytest

import mbridge_mxfp8_plugin as plugin
from mbridge_mxfp8_plugin import errors

ERRORS = ("MXFP8PluginError", "MXFP8ConfigError", "MXFP8AlignmentError", "MXFP8UsageError")


def test_the_package_root_exports_the_same_classes() -> None:
    for name in ERRORS:
        assert getattr(plugin, name) is getattr(errors, name), name
        assert name in plugin.__all__


def test_every_error_is_a_plugin_error_and_a_runtime_error() -> None:
    for name in ERRORS:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.MXFP8PluginError) and issubclass(cls, RuntimeError), name


def test_each_refusal_is_also_the_builtin_kind_it_reports() -> None:
    """A bad value is a ValueError, a wrong object a TypeError; a layout the plugin cannot repair
    is neither (the inputs were right, the buffers are not)."""
    assert issubclass(errors.MXFP8ConfigError, ValueError)
    assert not issubclass(errors.MXFP8ConfigError, TypeError)
    assert issubclass(errors.MXFP8UsageError, TypeError)
    assert not issubclass(errors.MXFP8UsageError, ValueError)
    assert not issubclass(errors.MXFP8AlignmentError, (ValueError, TypeError))
    assert not issubclass(errors.MXFP8PluginError, (ValueError, TypeError))


def test_a_bad_option_value_is_caught_as_a_value_error_with_its_message() -> None:
    from mbridge_mxfp8_plugin import PluginOptions

    with pytest.raises(ValueError, match=r"verify_sample must be a number in \(0, 1\], got 2.0") as err:
        PluginOptions(verify_sample=2.0)
    assert type(err.value) is errors.MXFP8ConfigError
    assert isinstance(err.value, errors.MXFP8PluginError)


def test_a_wrong_object_is_caught_as_a_type_error_with_its_message() -> None:
    from mbridge_mxfp8_plugin.config.validate import validate_config

    with pytest.raises(TypeError, match="DistributedDataParallelConfig") as err:
        validate_config(object())
    assert type(err.value) is errors.MXFP8UsageError
    assert isinstance(err.value, errors.MXFP8PluginError)


def test_the_message_is_the_one_raised() -> None:
    """No class rewrites or wraps the message: what the raise site wrote is what the user reads."""
    for name in ERRORS:
        err = getattr(errors, name)("ddp.bucket_size=3: use a multiple of 64")
        assert str(err) == "ddp.bucket_size=3: use a multiple of 64" and err.args == (str(err),)
