"""The recipe YAMLs this project ships (config/recipe_files.py), found by name as by path."""

from __future__ import annotations

from harness.console import TINY
from harness.console import cli as _cli


def test_check_finds_a_shipped_recipe_by_name():
    by_name = _cli("check", "tiny_debug_mxfp8", "--json")
    by_path = _cli("check", TINY, "--json")
    assert by_name.returncode == by_path.returncode == 0, by_name.stdout + by_name.stderr
    assert by_name.stdout.replace("tiny_debug_mxfp8", TINY, 1) == by_path.stdout
