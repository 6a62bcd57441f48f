"""The README is a front page that the code does not contradict.

What is checked here is what drifts silently: the two set-up commands CI and users start from, the
length budget, the shipped recipe names and options it lists, and its links. Its rendered blocks
(the defect and hazard tables ``doctor`` prints, options, figures) are checked with every other
doc's in ``test_docs.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

from mbridge_mxfp8_plugin.config.recipe_files import shipped_recipes
from mbridge_mxfp8_plugin.options import option_types

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_starts_with_exactly_two_setup_commands() -> None:
    body = README.split("\n", 1)[1].lstrip()
    m = re.match(r"```bash\n(.*?)```", body, re.S)
    assert m, "the README must open (after its title) with one bash block"
    commands = [line.split("#")[0].strip() for line in m.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no {target} target"
    assert "make test" in (REPO / ".ci" / "run").read_text(), "CI must run the README's test command"


def test_front_page_length() -> None:
    assert len(README.split()) <= 2000


def test_every_yaml_option_is_a_plugin_option_and_back() -> None:
    m = re.search(r"```yaml\nmxfp8_plugin:\n(.*?)```", README, re.S)
    assert m
    listed = {line.split(":")[0].strip() for line in m.group(1).splitlines() if line.strip()}
    assert listed == set(option_types())


def test_named_recipes_are_shipped() -> None:
    shipped = {Path(p).stem for p in shipped_recipes()}
    named = set(re.findall(r"`([a-z0-9_]+_mxfp8[a-z0-9_]*)`", README))
    assert named and named <= shipped, named - shipped


def test_relative_links_exist() -> None:
    for target in re.findall(r"\]\(((?!http)[^)#]+)\)", README):
        assert (REPO / target).exists(), target
