"""No page states a list or number that differs from its source or from another page.

``docs/render.py``'s blocks keep what they render equal to its source (``test_docs.py``); what a
page says in its own words is checked by ``render.CHECKS``: the defects of a release pair in any
table (against ``doctor``'s rule fed with each defect's ``fixed_in``), a defect table's "present
in" column, recipe names (against ``recipes/*.yaml``), plugin option names and YAML option lists
(against ``PluginOptions``), exit statuses (against ``common/exit_codes.py``), test counts and
times (``docs/testing.md`` only), the verifier's figures (``docs/verify.md`` only) and marker
blocks nobody renders. Each check is shown to fail: a copy of the pages with one contradiction
written in must be reported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("docs_render_agree", ROOT / "docs" / "render.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _renderer()
PAGES = render.pages()


def test_no_page_contradicts_a_source_or_another_page() -> None:
    problems = render.contradictions(PAGES)
    assert not problems, "\n".join(problems)


def _swap(doc: str, old: str, new: str) -> Callable[[dict[str, str]], dict[str, str]]:
    def edit(pages: dict[str, str]) -> dict[str, str]:
        assert old in pages[doc], f"{doc} no longer has {old!r}: update this case"
        return {**pages, doc: pages[doc].replace(old, new, 1)}

    return edit


def _add(doc: str, text: str) -> Callable[[dict[str, str]], dict[str, str]]:
    return lambda pages: {**pages, doc: pages[doc] + "\n" + text + "\n"}


#: (check, the page it must name, a contradiction written into a copy of the pages)
CONTRADICTIONS = [
    # issue 30 item 12: a release pair's defects differ from doctor's (and so from the other page)
    (
        "release_rows",
        "docs/compatibility.md",
        _swap("docs/compatibility.md", "| 0.18.2 | 0.5.1 | 3.12 | B2, C |", "| 0.18.2 | 0.5.1 | 3.12 | C |"),
    ),
    (
        "release_rows",
        "README.md",
        _add(
            "README.md",
            "| your stack | defects present |\n|---|---|\n| megatron-core 0.19.x + Bridge 0.6.x | none |",
        ),
    ),
    (
        "release_rows",
        "docs/compatibility.md",
        _swap(
            "docs/compatibility.md",
            "| 0.19.2 | 0.6.2 | 3.12 | none | present | fixed |",
            "| 0.19.2 | 0.6.2 | 3.12 | none | present | present |",
        ),
    ),
    (
        "present_in_rows",
        "docs/upstream.md",
        _swap("docs/upstream.md", "| bridge <= 0.5.x", "| bridge <= 0.4.x"),
    ),
    (
        "present_in_rows",
        "docs/upstream.md",
        lambda pages: {
            **pages,
            "docs/upstream.md": "\n".join(
                line for line in pages["docs/upstream.md"].splitlines() if not line.startswith("| F |")
            ),
        },
    ),
    # issue 30 item 13: a recipe list short of recipes/, a partial option list that looks whole
    (
        "recipe_mentions",
        "docs/check.md",
        _swap("docs/check.md", ", `tiny_gpt_mxfp8_launch`<!-- recipes:end -->", "<!-- recipes:end -->"),
    ),
    ("recipe_mentions", "docs/launch.md", _add("docs/launch.md", "Run `tiny_moe_mxfp8_pretrain`.")),
    (
        "option_mentions",
        "docs/check.md",
        _add(
            "docs/check.md",
            "```yaml\nmxfp8_plugin:\n"
            + "".join(f"  {name}: x\n" for name in list(render._defaults())[:-2])
            + "```",
        ),
    ),
    ("option_mentions", "docs/bridge.md", _add("docs/bridge.md", "Set `mxfp8_plugin.verify_weight=true`.")),
    # exit statuses are common/exit_codes.py's
    ("exit_code_mentions", "docs/launch.md", _add("docs/launch.md", "A refusal exits 3.")),
    # issue 30 item 9: test counts and times live in docs/testing.md only
    ("test_figures_outside_testing", "README.md", _add("README.md", "`make test-fast` (about a minute).")),
    ("test_figures_outside_testing", "docs/robustness.md", _add("docs/robustness.md", "64 passed.")),
    # issue 30 item 11: the verifier's cost is said on docs/verify.md only
    (
        "homeless_figures",
        "docs/performance.md",
        _add("docs/performance.md", "The sampled check costs 0.12x an eval transition."),
    ),
    (
        "unregistered_blocks",
        "docs/performance.md",
        _add("docs/performance.md", "<!-- verify-te-ratio:begin -->old<!-- verify-te-ratio:end -->"),
    ),
]


@pytest.mark.parametrize(
    ("check", "doc", "edit"),
    CONTRADICTIONS,
    ids=[f"{c}-{d}-{i}" for i, (c, d, _) in enumerate(CONTRADICTIONS)],
)
def test_a_contradiction_is_reported(
    check: str, doc: str, edit: Callable[[dict[str, str]], dict[str, str]]
) -> None:
    """Each check fails on the pages with one contradiction written in, naming that page."""
    assert not getattr(render, check)(PAGES), "the pages as committed must pass first"
    found = getattr(render, check)(edit(PAGES))
    assert any(line.startswith(f"{doc}:") for line in found), found


def test_every_check_is_shown_to_fail() -> None:
    shown = {check for check, _, _ in CONTRADICTIONS}
    assert shown == {c.__name__ for c in render.CHECKS}


def test_a_verifier_renderer_on_another_page_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = {
        **render.BLOCKS,
        "README.md": {**render.BLOCKS["README.md"], "verify-te-ratio": render.verify_te_ratio},
    }
    monkeypatch.setattr(render, "BLOCKS", blocks)
    assert any("README.md: renders 'verify-te-ratio'" in line for line in render.homeless_figures(PAGES))


def test_the_release_table_is_doctors_rule_on_fixed_in() -> None:
    """The rendered pairs are what CI installs, and a defect's fix release moves its rows."""
    pairs = render.release_pairs()
    assert len(pairs) == len(list((ROOT / "requirements").glob("core*.txt")))
    assert render.pair_defects("0.19.2", "0.6.2") == dict(
        A=False, B1=False, B2=False, C=False, E=True, F=False
    )
    assert render.pair_defects("0.18.2", "0.5.1")["B2"] is True  # 0.5 stages before evals only
    assert render.pair_defects("0.16.1", "0.3.1") == dict.fromkeys(render.DEFECTS, True)


def test_a_fix_release_moved_in_the_source_fails_the_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other direction: the source changes, and both the rendered tables and the rows written
    by hand no longer agree with it."""
    import dataclasses

    later = dataclasses.replace(render.DEFECTS["C"], fixed_in="megatron-core 0.20.0 (#5487)")
    monkeypatch.setattr(render, "DEFECTS", {**render.DEFECTS, "C": later})
    drift = render.drift()
    assert "README.md: block 'release-defects' differs from its source" in drift
    assert "docs/compatibility.md: block 'release-defects' differs from its source" in drift
    assert any(
        line.startswith("docs/compatibility.md: core 0.19 + Bridge 0.3")
        for line in render.release_rows(PAGES)
    )
