"""Where Megatron-Bridge (and megatron-core) come from, and which release that is.

Megatron-Bridge is being folded into Megatron-LM (Megatron-Bridge #6172): ``megatron/bridge`` may
then be installed by Megatron-LM's distribution, not by ``megatron-bridge``. The layouts below are
what ``pip install --target`` writes (a ``RECORD`` of installed files, ``package_info.py`` with
``MAJOR``/``MINOR``/``PATCH``) and what ``pip install -e`` leaves (``direct_url.json``); the fold
itself is not released, so the folded layout is built by hand the way pip would write it. The
installed stack is checked against ``importlib.metadata`` as well.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.probes import versions
from mbridge_mxfp8_plugin.probes.stack import InstalledStack
from mbridge_mxfp8_plugin.probes.versions import installed_versions, package_origin

pytestmark = pytest.mark.matrix  # every release-pair cell runs it (.ci/matrix.sh)

INFO = 'MAJOR = {0}\nMINOR = {1}\nPATCH = {2}\nPRE_RELEASE = "{3}"\n__version__ = "ignored"\n'


@pytest.fixture(autouse=True)
def _fresh_caches():
    versions._clear_caches()
    yield
    versions._clear_caches()


def _package(site: Path, name: str, version: tuple[int, int, int, str]) -> Path:
    pkg = site / "megatron" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "package_info.py").write_text(INFO.format(*version))
    if name == "core":  # what _source's probes look for
        (pkg / "distributed").mkdir()
        (pkg / "distributed" / "param_and_grad_buffer.py").write_text("")
    return pkg


def _dist_info(site: Path, dist: str, version: str, files: list[str], direct_url: dict | None = None) -> Path:
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},sha256=x,1\n" for f in files))
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return info


def test_installed_stack_matches_importlib_metadata() -> None:
    """On a normal install the answer is what pip says, and the owner is Bridge's own distribution."""
    origin = package_origin("bridge")
    try:
        want = metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        want = None
    if origin is None:
        assert installed_versions()["megatron-bridge"] is None
        return
    assert origin.distribution == "megatron-bridge", origin
    assert origin.version == want == installed_versions()["megatron-bridge"]
    assert origin.describe() == f"{want} (megatron-bridge distribution)"
    core = package_origin("core")
    assert core is not None and core.distribution == "megatron-core"
    assert installed_versions()["megatron-core"] == metadata.version("megatron-core")


def test_bridge_folded_into_megatron_lm_distribution(tmp_path: Path, monkeypatch) -> None:
    """``megatron/bridge`` installed by Megatron-LM's distribution: Bridge's own release is read
    from its package_info, the owner named, and a stale ``megatron-bridge`` dist-info elsewhere on
    the path (an older wheel whose package is shadowed) does not answer."""
    folded, stale = tmp_path / "folded", tmp_path / "stale"
    _package(folded, "core", (0, 20, 0, ""))
    _package(folded, "bridge", (0, 7, 0, "rc1"))
    _dist_info(
        folded, "megatron_core", "0.20.0", ["megatron/core/__init__.py", "megatron/bridge/__init__.py"]
    )
    _package(stale, "bridge", (0, 6, 2, ""))
    _dist_info(stale, "megatron_bridge", "0.6.2", ["megatron/bridge/__init__.py"])
    monkeypatch.syspath_prepend(str(stale))
    monkeypatch.syspath_prepend(str(folded))

    origin = package_origin("bridge")
    assert origin is not None
    assert (origin.distribution, origin.distribution_version, origin.version) == (
        "megatron-core",
        "0.20.0",
        "0.7.0rc1",
    )
    assert origin.path == str(folded / "megatron" / "bridge")
    assert origin.describe() == "0.7.0rc1 (inside the megatron-core 0.20.0 distribution)"
    assert installed_versions()["megatron-bridge"] == "0.7.0rc1"
    # check's installed-pair line (InstalledStack.describe) says where Bridge came from
    described = InstalledStack.detect().describe()
    assert "megatron-bridge 0.7.0rc1 (inside the megatron-core 0.20.0 distribution)" in described
    assert "megatron-core 0.20.0" in described


def test_source_tree_on_pythonpath_has_no_distribution(tmp_path: Path, monkeypatch) -> None:
    """A snapshot put on PYTHONPATH (how the core-main runs here use Megatron-LM main): no
    dist-info owns it, the version is its package_info's, and an installed wheel it shadows is
    not reported."""
    shadowed = tmp_path / "site"
    _package(shadowed, "bridge", (0, 6, 2, ""))
    _dist_info(shadowed, "megatron_bridge", "0.6.2", ["megatron/bridge/__init__.py"])
    tree = tmp_path / "checkout" / "src"
    _package(tree, "bridge", (0, 7, 0, ""))
    monkeypatch.syspath_prepend(str(shadowed))
    monkeypatch.syspath_prepend(str(tree))

    origin = package_origin("bridge")
    assert origin is not None and origin.distribution is None and origin.version == "0.7.0"
    assert origin.describe() == f"0.7.0 (source tree {tree / 'megatron' / 'bridge'}, no distribution)"
    assert installed_versions()["megatron-bridge"] == "0.7.0"


def test_editable_install_is_its_own_distribution(tmp_path: Path, monkeypatch) -> None:
    """``pip install -e Megatron-Bridge``: the dist-info sits in site-packages, the code in the
    checkout's ``src``; the dist-info's ``direct_url.json`` ties them together."""
    project = tmp_path / "Megatron-Bridge"
    _package(project / "src", "bridge", (0, 7, 0, ""))
    site = tmp_path / "site"
    _dist_info(
        site, "megatron_bridge", "0.7.0", [], {"url": project.as_uri(), "dir_info": {"editable": True}}
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(project / "src"))

    origin = package_origin("bridge")
    assert origin is not None
    assert (origin.distribution, origin.editable, origin.version) == ("megatron-bridge", True, "0.7.0")
    assert origin.describe() == "0.7.0 (editable megatron-bridge distribution)"


def test_dist_info_without_its_package_does_not_answer(tmp_path: Path, monkeypatch) -> None:
    """A dist-info left first on the path with no ``megatron/bridge`` beside it (a half-removed
    wheel) is what ``importlib.metadata`` would report; the version reported is that of the
    Bridge ``import megatron.bridge`` loads, or none."""
    real = package_origin("bridge")
    site = tmp_path / "site"
    _dist_info(site, "megatron_bridge", "9.9.9", ["megatron/bridge/__init__.py"])
    monkeypatch.syspath_prepend(str(site))
    versions._clear_caches()
    assert metadata.version("megatron-bridge") == "9.9.9"  # what a dist-info reader says
    assert installed_versions()["megatron-bridge"] == (real.version if real else None)


def test_doctor_names_where_bridge_comes_from(tmp_path: Path, monkeypatch) -> None:
    """``doctor`` (text and --json) reports Bridge's release and its owner for the folded layout."""
    import io

    from mbridge_mxfp8_plugin.commands.doctor import diagnose, render

    folded = tmp_path / "folded"
    _package(folded, "core", (0, 20, 0, ""))
    _package(folded, "bridge", (0, 7, 0, ""))
    _dist_info(
        folded, "megatron_core", "0.20.0", ["megatron/core/__init__.py", "megatron/bridge/__init__.py"]
    )
    monkeypatch.syspath_prepend(str(folded))
    report = diagnose()
    assert report["versions"]["megatron-bridge"] == "0.7.0"
    assert report["bridge_origin"]["distribution"] == "megatron-core"
    out = io.StringIO()
    render(report, out)
    assert "megatron.bridge      0.7.0 (inside the megatron-core 0.20.0 distribution)" in out.getvalue()
