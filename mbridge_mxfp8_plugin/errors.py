"""Errors the plugin raises. Each message names the knob or object, the value seen and the fix."""

from __future__ import annotations


class MXFP8PluginError(RuntimeError):
    """Base class: the plugin refuses to continue rather than let training run on wrong weights."""


class MXFP8ConfigError(MXFP8PluginError, ValueError):
    """An inconsistent or unsupported combination of MXFP8 / distributed-optimizer knobs."""


class MXFP8AlignmentError(MXFP8PluginError):
    """A bucket layout the plugin cannot repair (a param start that is not 64-element aligned)."""


class MXFP8UsageError(MXFP8PluginError, TypeError):
    """The plugin was handed something it cannot work with (wrong model or optimizer type)."""
