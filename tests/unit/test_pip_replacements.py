"""probes/pip_replacements.py: which installed packages ``pip install`` would replace, judged from
synthetic ``.dist-info`` directories (a temporary ``sys.path`` entry each, read through
``importlib.metadata``'s own path finder), and, in two cases, against pip's real resolver.

The cases are the container's: NGC's ``torch 2.6.0a0+ecf3bae40a.nv25.01`` under megatron-core 0.16.1's
``torch>=2.6.0`` (replaced, though the plugin's own ``torch>=2.6.0a0`` accepts it), a pre-release
inside its range (kept, as pip keeps it), a container's ``omegaconf 2.4.0.dev3`` under the plugin's
``omegaconf<2.4`` (replaced), and metadata that is missing or broken (unchecked, never "keeps").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from mbridge_mxfp8_plugin.commands import doctor
from mbridge_mxfp8_plugin.probes.pip_replacements import (
    PLUGIN_DIST,
    is_container_build,
    judge_install,
    pip_replacements,
    replaced_names,
)

#: the wheel's Requires-Dist (pyproject.toml [project] dependencies, and one extra)
PLUGIN_REQUIRES = [
    "torch>=2.6.0a0",
    "megatron-core>=0.14.0a0",
    "pyyaml>=6.0",
    "omegaconf<2.4,>=2.3.0",
    "hydra-core<1.4,>=1.3.0",
    'lightning>=2.4.0a0; extra == "lightning"',
]
NGC_TORCH = "2.6.0a0+ecf3bae40a.nv25.01"
SCOPE = "pip install <the plugin's wheel>"


def _metadata(name: str, version: str, requires: list[str]) -> str:
    head = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    return head + "".join(f"Requires-Dist: {r}\n" for r in requires)


def _dist(where: Path, name: str, version: str, requires: list[str] = (), metadata: bool = True) -> None:  # type: ignore[assignment]
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    if metadata:
        (info / "METADATA").write_text(_metadata(name, version, list(requires)))


def _container(
    where: Path,
    *,
    torch: str = NGC_TORCH,
    core_torch: str = "torch>=2.6.0",
    omegaconf: str = "2.3.0",
    plugin: bool = True,
) -> Path:
    """An NGC-like set of installed distributions (no code: pip and the judge read metadata only)."""
    _dist(where, "torch", torch)
    core = [core_torch, "numpy", 'transformer-engine[pytorch]>=2.9.0a0; extra == "dev"']
    _dist(where, "megatron-core", "0.16.1", core)
    _dist(where, "numpy", "1.26.4")
    _dist(where, "omegaconf", omegaconf, ["PyYAML>=5.1.0"])
    _dist(where, "PyYAML", "6.0.2")
    _dist(where, "hydra-core", "1.3.2", ["omegaconf>=2.2"])
    _dist(where, "transformer-engine", "2.8.0+cafe")
    if plugin:
        _dist(where, PLUGIN_DIST, "0.1.0", PLUGIN_REQUIRES)
    return where


def _judge(where: Path, root: str = PLUGIN_DIST):
    return judge_install(root, SCOPE, path=[str(where)])


# --------------------------------------------------------------------------- the container cases
def test_ngc_torch_prerelease_is_replaced_through_megatron_core(tmp_path):
    verdict = _judge(_container(tmp_path))
    assert verdict.status == "replaces", verdict
    (torch,) = verdict.replacements
    assert (torch.package, torch.installed, torch.requirement) == ("torch", NGC_TORCH, "torch>=2.6.0")
    assert torch.required_by == "megatron-core 0.16.1"
    assert torch.via == (f"{PLUGIN_DIST} 0.1.0", "megatron-core 0.16.1")
    assert torch.container_build and "pre-release of 2.6.0" in torch.why, torch
    assert "megatron-core 0.16.1 requires torch>=2.6.0" in torch.line()


@pytest.mark.parametrize(
    ("torch", "core_torch"),
    [(NGC_TORCH, "torch>=2.5"), ("2.6.0+nv25.03", "torch>=2.6.0"), (NGC_TORCH, "torch>=2.6.0a0")],
    ids=["prerelease-inside-the-range", "local-build-of-the-bound", "prerelease-bound"],
)
def test_a_satisfied_container_is_silent(tmp_path, torch, core_torch):
    """pip keeps an installed pre-release or local build inside the range (its installed-candidate
    rule is contains(prereleases=True)); so does the judge, and it says it checked something."""
    verdict = _judge(_container(tmp_path, torch=torch, core_torch=core_torch))
    assert verdict.status == "keeps" and not verdict.replacements and not verdict.unchecked, verdict
    # every requirement on an installed package is read: the plugin's five, core's two, omegaconf's, hydra's
    assert verdict.checked == 9, verdict.checked


def test_omegaconf_24_prerelease_is_replaced_by_the_plugins_cap(tmp_path):
    verdict = _judge(_container(tmp_path, torch="2.6.0", omegaconf="2.4.0.dev3"))
    assert replaced_names(verdict.replacements) == ["omegaconf"], verdict
    (cap,) = verdict.replacements
    assert cap.requirement == "omegaconf<2.4,>=2.3.0" and cap.required_by == f"{PLUGIN_DIST} 0.1.0"
    assert not cap.container_build and "pre-releases" in cap.why, cap


def test_both_at_once_list_the_container_build_first(tmp_path):
    verdict = _judge(_container(tmp_path, omegaconf="2.4.0.dev3"))
    assert replaced_names(verdict.replacements) == ["torch", "omegaconf"]


def test_extras_on_the_way_are_walked(tmp_path):
    """Bridge asks for ``megatron-core[dev]``: core's ``dev`` requirements are judged (TE 2.8 is
    below >=2.9.0a0); the plugin asks for no extra, so its install does not reach them."""
    where = _container(tmp_path, torch="2.6.0")
    _dist(where, "megatron-bridge", "0.3.1", ["megatron-core[dev]>=0.15.0a0"])
    assert _judge(where).status == "keeps"
    bridge = _judge(where, "megatron-bridge")
    assert replaced_names(bridge.replacements) == ["transformer-engine"], bridge
    assert bridge.replacements[0].requirement == "transformer-engine>=2.9.0a0"


# --------------------------------------------------------------------------- what it cannot read
def test_missing_plugin_metadata_is_unchecked_never_keeps(tmp_path):
    verdict = _judge(_container(tmp_path, plugin=False))
    assert verdict.status == "unchecked" and verdict.root_version is None, verdict
    assert "no installed metadata" in verdict.unchecked[0], verdict.unchecked


def test_broken_metadata_on_the_way_is_unchecked(tmp_path):
    where = _container(tmp_path, torch="2.6.0")
    for meta in where.glob("megatron_core-*.dist-info/METADATA"):
        meta.unlink()  # the directory stays: a broken install, not a missing one
    verdict = _judge(where)
    assert verdict.status == "unchecked", verdict
    assert any("megatron-core" in u and "no Name or Version" in u for u in verdict.unchecked), verdict


def test_a_required_package_not_installed_is_unchecked(tmp_path):
    """pip adds an index release; what that release requires is not here to read."""
    where = tmp_path
    _dist(where, "torch", "2.6.0")
    _dist(where, PLUGIN_DIST, "0.1.0", ["torch>=2.6.0a0", "megatron-core>=0.14.0a0"])
    verdict = _judge(where)
    assert verdict.status == "unchecked" and verdict.added == ("megatron-core",), verdict


def test_an_unparsable_version_is_unchecked(tmp_path):
    where = _container(tmp_path)
    (next(where.glob("torch-*.dist-info")) / "METADATA").write_text(_metadata("torch", "nightly-cu128", []))
    verdict = _judge(where)
    assert verdict.status == "unchecked" and any("not a PEP 440 version" in u for u in verdict.unchecked)


def test_pip_replacements_judges_bridge_only_where_it_is_installed(tmp_path):
    where = _container(tmp_path)
    assert [v.root for v in pip_replacements([str(where)])] == [PLUGIN_DIST]
    _dist(where, "megatron-bridge", "0.3.1", ["torch>=2.6.0"])
    plugin, bridge = pip_replacements([str(where)])
    assert bridge.root == "megatron-bridge" and replaced_names(bridge.replacements) == ["torch"]


def test_container_builds():
    builds = ("torch", "megatron_core", "Megatron-Bridge", "transformer_engine_torch", "nvidia-cudnn-cu12")
    for name in builds:
        assert is_container_build(name), name
    assert not any(is_container_build(n) for n in ("omegaconf", "hydra-core", "pyyaml"))


# --------------------------------------------------------------------------- doctor prints it
def test_doctor_names_package_requirement_requirer_and_fix(tmp_path):
    lines: list[str] = []
    verdicts = pip_replacements([str(_container(tmp_path, omegaconf="2.4.0.dev3"))])
    doctor._render_pip([v.as_dict() for v in verdicts], lines.append)
    text = "\n".join(lines)
    assert f"{SCOPE}: REPLACES torch, omegaconf" in text, text
    assert f"torch {NGC_TORCH}: megatron-core 0.16.1 requires torch>=2.6.0" in text, text
    assert f"omegaconf 2.4.0.dev3: {PLUGIN_DIST} 0.1.0 requires omegaconf<2.4,>=2.3.0" in text, text
    assert "fix: pip install --no-deps <wheel>" in text and "docs/container.md" in text, text


def test_doctor_says_unchecked_with_the_reason(tmp_path):
    lines: list[str] = []
    verdicts = pip_replacements([str(_container(tmp_path, plugin=False))])
    doctor._render_pip([v.as_dict() for v in verdicts], lines.append)
    assert lines[1] == f"  {SCOPE}: unchecked", lines
    assert lines[2].startswith(f"    unchecked: {PLUGIN_DIST} has no installed metadata"), lines
    assert not any("keeps" in ln for ln in lines), lines


# --------------------------------------------------------------------------- pip itself
def _wheel(out: Path, name: str, version: str, requires: list[str] = ()) -> Path:  # type: ignore[assignment]
    tag = f"{name.replace('-', '_')}-{version}"
    path = out / f"{tag}-py3-none-any.whl"
    files = {
        f"{tag}.dist-info/METADATA": _metadata(name, version, list(requires)),
        f"{tag}.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in files.items():
            zf.writestr(n, text)
        record = f"{tag}.dist-info/RECORD"
        zf.writestr(record, "".join(f"{n},,\n" for n in [*files, record]))
    return path


@pytest.mark.parametrize(
    ("core_torch", "omegaconf", "replaced"),
    [("torch>=2.6.0", "2.4.0.dev3", {"torch", "omegaconf"}), ("torch>=2.5", "2.3.1.dev0", set())],
    ids=["ngc", "inside-the-ranges"],
)
def test_the_judge_agrees_with_pips_resolver(tmp_path, core_torch, omegaconf, replaced):
    """pip's real resolver (``pip --python <venv> install --dry-run --report``) on the same
    installed metadata, the plugin's wheel and an index holding releases for what it would replace:
    what pip would install besides the plugin is what the judge says it replaces."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    _container(site, core_torch=core_torch, omegaconf=omegaconf, plugin=False)
    index = tmp_path / "index"
    index.mkdir()
    for name, version in (("torch", "2.6.0"), ("torch", "2.9.0"), ("omegaconf", "2.3.0")):
        _wheel(index, name, version)
    wheel = _wheel(tmp_path, PLUGIN_DIST, "0.1.0", PLUGIN_REQUIRES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [sys.executable, "-m", "pip", "--python", str(py), "install", "--dry-run", "-q", "--report", "-"]
    proc = subprocess.run(
        [*cmd, "--no-index", "--find-links", str(index), str(wheel)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if proc.returncode != 0 and "no such option: --python" in proc.stderr:
        pytest.skip("pip older than 22.3 (no --python)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installs = {i["metadata"]["name"].lower() for i in json.loads(proc.stdout)["install"]}
    assert installs - {PLUGIN_DIST} == replaced, installs

    _dist(site, PLUGIN_DIST, "0.1.0", PLUGIN_REQUIRES)  # the judge reads the installed plugin
    verdict = _judge(site)
    assert set(replaced_names(verdict.replacements)) == replaced, verdict
    assert verdict.status == ("replaces" if replaced else "keeps"), verdict
