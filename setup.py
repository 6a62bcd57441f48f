"""Build hook: ship the top-level ``recipes/*.yaml`` inside the wheel as ``mbridge_mxfp8_plugin/recipes``.

Everything else is declared in pyproject.toml. The recipes stay at the repository's top level
(where the README and Bridge users look for them); a declarative ``package-dir`` mapping would need
the package list spelled out by hand, so the copy happens here instead.
:func:`mbridge_mxfp8_plugin.config.recipe_files.recipe_path` finds them in either place.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

RECIPES = Path(__file__).resolve().parent / "recipes"
TARGET = Path("mbridge_mxfp8_plugin", "recipes")


class BuildPyWithRecipes(build_py):
    def run(self) -> None:
        super().run()
        # An editable install reads the checkout's recipes/ directly (recipe_files looks there).
        if getattr(self, "editable_mode", False):
            return
        for src in sorted(RECIPES.glob("*.yaml")):
            dst = Path(self.build_lib, TARGET, src.name)
            self.mkpath(str(dst.parent))
            self.copy_file(str(src), str(dst))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = (
            []
            if getattr(self, "editable_mode", False)
            else [str(Path(self.build_lib, TARGET, src.name)) for src in sorted(RECIPES.glob("*.yaml"))]
        )
        return [*super().get_outputs(include_bytecode), *extra]


setup(cmdclass={"build_py": BuildPyWithRecipes})
