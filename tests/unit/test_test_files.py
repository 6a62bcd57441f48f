"""Every package module has its test file by name, in the tier folder where it is tested.

A reader looking for the tests of ``mbridge_mxfp8_plugin/<room>/<name>.py`` opens
``tests/<tier>/test_<name>.py`` (docs/testing.md, "Where the tests of a module are"). Where two
rooms have a module of the same name (``config/read.py`` and ``verify/read.py``), the file is
``test_<room>_<name>.py`` (``test_config_read.py``), except for the one module :data:`CLAIMS` gives
the bare name. A module may have several files (a unit one and a ranks one); this test asks for one.

Not modules of their own, so not asked: ``__init__.py``, ``__main__.py`` and the root's re-export
aliases ``lightning.py``, ``recipes.py``, ``launch.py`` (the paths users import; their targets,
``adapters/lightning.py``, ``adapters/recipes.py`` and ``commands/launch.py``, are asked). A module
with a leading underscore is a private helper of one public sibling that alone imports it (or of
the room's public modules): :data:`PRIVATE` names that sibling, whose test file covers it, and
this test checks the sibling has one.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "mbridge_mxfp8_plugin"
TIERS = ("unit", "ranks", "bridge_real", "nemo", "gpu")
ROOT_ALIASES = {"lightning", "recipes", "launch"}  # re-exports of adapters/ and commands/ modules

#: A name two rooms share, given bare to one module; the others carry their room in the file name.
CLAIMS = {
    "hazards": "config.rules.hazards",  # test_hazards.py; the probe: test_probes_hazards.py
    "resume": "engine.resume",  # tests/ranks/test_resume.py; probes/resume.py: test_probes_resume.py
    "read": "verify.read",  # test_read.py; config/read.py: test_config_read.py
}

#: Private module -> the public module whose tests cover it.
PRIVATE = {
    "config._bounds": "config.read",  # hostile files: test_config_read.py's anchor bombs and sizes
    "config._overrides": "config.read",  # Hydra overrides, applied by the reader only
    "config.rules._base": "config.validate",  # the rule registry validate_config runs
    "probes._source": "probes.fields",  # the installed megatron files as text, under every probe
    "probes._summary": "probes.fields",  # test_fields.py's summary-cache tests
    "testing._registry": "testing.emulated_mxfp8",  # test_emulated_mxfp8.py's registration test
    "verify._attribute": "verify.shard",  # naming a failed batch's params (test_shard's failures)
    "verify._crafted": "verify.probe",  # the fused kernel's gate blocks (test_fused's agreement tests)
    "verify._flags": "verify.shard",  # a call's one zeroed flags tensor (test_graphs' few-batch plans)
    "verify._gather_kernel": "verify.fused",  # the own-write batches' gathers (fused.GatherLaunch)
    "verify._program_rows": "verify.fused",  # a program's item row (every launch's segments)
    "verify._tables": "verify.fused",  # the launches' tables and their one copy to the device
    "verify._te_rule_kernel": "verify.fused",  # the Triton kernel behind fused.py
    "verify._templates": "verify.graphs",  # an own-write key recorded once (test_graphs' plans)
    "verify._values_kernel": "verify.fused",  # the values batches' Triton kernel (fused.ValuesLaunch)
}

#: Modules whose test file another change in progress brings (remove the entry when it lands).
PENDING: dict[str, str] = {}

#: Modules with no direct test, and why. Keep it short: a module that has tests somewhere gets a
#: file of its own by moving them there, not an entry here. Empty: every module has its file
#: (even ``errors`` and ``config.values``: the hierarchy and the records users and rules rely on).
EXEMPT: dict[str, str] = {}


def _modules() -> list[tuple[str, ...]]:
    """Every package module as its path parts under the package, less the files that are none."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts[-1] in ("__init__", "__main__") or (len(parts) == 1 and parts[0] in ROOT_ALIASES):
            continue
        found.append(parts)
    return found


MODULES = _modules()
PUBLIC = [m for m in MODULES if not m[-1].startswith("_")]
SHARED = {name for name, n in Counter(m[-1] for m in PUBLIC).items() if n > 1}
TEST_FILES = {p.stem: p for tier in TIERS for p in (ROOT / "tests" / tier).glob("test_*.py")}


def _dotted(parts: tuple[str, ...]) -> str:
    return ".".join(parts)


def _names(parts: tuple[str, ...]) -> set[str]:
    """The test file stems that count as this module's."""
    name = parts[-1]
    names = {f"test_{room}_{name}" for room in parts[:-1]}
    if name not in SHARED or CLAIMS.get(name) == _dotted(parts):
        names.add(f"test_{name}")
    return names


def _test_files(parts: tuple[str, ...]) -> list[str]:
    return sorted(str(TEST_FILES[n].relative_to(ROOT)) for n in _names(parts) if n in TEST_FILES)


@pytest.mark.parametrize("module", [_dotted(m) for m in PUBLIC])
def test_module_has_its_test_file(module: str) -> None:
    parts = tuple(module.split("."))
    if module in EXEMPT or module in PENDING:
        return
    assert _test_files(parts), (
        f"mbridge_mxfp8_plugin/{'/'.join(parts)}.py has no tests/<tier>/ file named "
        f"{' or '.join(sorted(n + '.py' for n in _names(parts)))}: move its tests there "
        "(or, with the reason, add it to EXEMPT in tests/unit/test_test_files.py)"
    )


def test_exemptions_are_current() -> None:
    """EXEMPT and the other tables name modules that exist; an exempt module that gained a test
    file, or a public one listed as private, is a stale entry."""
    dotted = {_dotted(m) for m in MODULES}
    for table in (EXEMPT, PENDING, PRIVATE):
        assert set(table) <= dotted, sorted(set(table) - dotted)
    assert set(CLAIMS.values()) <= dotted and set(CLAIMS) <= SHARED, CLAIMS
    stale = {m: _test_files(tuple(m.split("."))) for m in EXEMPT if _test_files(tuple(m.split(".")))}
    assert not stale, f"these exempt modules have test files now; drop them from EXEMPT: {stale}"
    assert not set(EXEMPT) & set(PENDING)


def test_private_modules_are_covered_by_their_public_sibling() -> None:
    private = {_dotted(m) for m in MODULES if m[-1].startswith("_")}
    assert set(PRIVATE) == private, "a private module needs the public module its tests live with"
    for module, owner in PRIVATE.items():
        assert _test_files(tuple(owner.split("."))), (module, owner)


def test_the_checker_sees_clashing_names() -> None:
    """The control: a shared name needs the room in the file name unless the module claims it."""
    assert {"read", "report", "hazards", "resume"} <= SHARED
    assert "test_read" not in _names(("config", "read")) and "test_config_read" in _names(("config", "read"))
    assert "test_hazards" in _names(("config", "rules", "hazards"))
    assert "test_hazards" not in _names(("probes", "hazards"))
    assert _test_files(("config", "read")) == ["tests/unit/test_config_read.py"]


def test_docs_table_lists_every_module() -> None:
    """docs/testing.md's "Where the tests of a module are" has a row for every module, and none more."""
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    section = text.split("### Where the tests of a module are", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(?:mbridge_mxfp8_plugin/)?([\w/]+)\.py` \|", section, re.M)
    assert sorted(rows) == sorted("/".join(m) for m in MODULES)
