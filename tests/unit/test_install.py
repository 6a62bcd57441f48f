"""The wheel as users get it: what it contains, what it declares, and that pip installs it into an
NGC-style environment without replacing the container's torch or megatron-core.

NVIDIA's containers ship pre-release and local builds (``2.6.0a0+ecf3bae40a.nv25.01``,
``0.14.0rc5``). A bound such as ``torch>=2.6`` rejects those, and pip then "upgrades" the container's
CUDA build to a PyPI wheel. The venv test below holds minimal stand-ins with those version strings
and runs pip's real resolver against the built wheel; the other dependencies come from the index
pip is configured with.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "mbridge_mxfp8_plugin"

#: versions as NGC's PyTorch / NeMo containers report them
NGC_VERSIONS = {
    "torch": ["2.6.0a0+ecf3bae40a.nv25.01", "2.7.0a0+79aa17489c.nv25.04", "2.9.0a0+50eac811a6.nv25.09"],
    "megatron-core": ["0.14.0rc5", "0.15.0rc7", "0.16.0rc0+nv25.11"],
    "megatron-bridge": ["0.2.0rc6", "0.3.0rc0", "0.4.0rc2+nv26.01"],
}
#: what the venv test installs as torch / megatron-core (the first of each list above)
FAKE = {"torch": NGC_VERSIONS["torch"][0], "megatron-core": NGC_VERSIONS["megatron-core"][0]}
#: Megatron-Bridge's GPU stack: no requirement of the wheel, extras included, may pull any of these
GPU_STACK = {"megatron-bridge", "transformer-engine", "mamba-ssm", "causal-conv1d", "flash-attn"}


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    kw.setdefault("env", env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]


def _clean_checkout(dest: Path) -> Path:
    """The files a fresh clone has (tracked, plus new files git does not ignore): no build/, no egg-info."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT)
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist): copy what matters
        shutil.copytree(
            ROOT, dest, ignore=shutil.ignore_patterns("__pycache__", ".venv*", "build", "*.egg-info")
        )
        return dest
    for rel in filter(None, listed.stdout.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per session, from a clean copy of the checkout, with pip's isolated build
    (so ``[build-system] requires`` is what gets used)."""
    base = tmp_path_factory.mktemp("wheel")
    src = _clean_checkout(base / "src")
    out = base / "dist"
    proc = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="session")
def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def _requirements(metadata: email.message.Message) -> list[Requirement]:
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def test_wheel_contents(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    shipped_recipes = {p.name for p in (ROOT / "recipes").glob("*.yaml")}
    assert shipped_recipes, "the checkout has no recipes/*.yaml"
    assert {n.rsplit("/", 1)[1] for n in names if n.startswith(f"{PACKAGE}/recipes/")} == shipped_recipes
    assert f"{PACKAGE}/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    others = {n.split("/", 1)[0] for n in names} - {PACKAGE}
    assert len(others) == 1 and others.pop().endswith(".dist-info"), "top-level entries besides the package"
    test_only = [
        n for n in names if n.rsplit("/", 1)[-1] in ("te_stub.py", "bridge_cpu.py") or "/tests/" in n
    ]
    assert not test_only, f"test-only code in the wheel: {test_only}"


def test_license_and_classifiers(metadata: email.message.Message):
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: the expression only
    assert metadata.get_all("Project-URL")


@pytest.mark.parametrize("dist", ["torch", "megatron-core"])
def test_bounds_accept_ngc_builds(metadata: email.message.Message, dist: str):
    bounds = [r.specifier for r in _requirements(metadata) if r.name == dist and r.marker is None]
    assert bounds, f"{dist} is not a requirement of the wheel"
    spec = SpecifierSet(",".join(str(b) for b in bounds))
    for version in NGC_VERSIONS[dist]:
        # contains() with its default prerelease rule, the one pip applies to an installed version
        assert spec.contains(version), f"{dist} {version} (an NGC build) is rejected by {spec}"
    # the bound is still a lower bound: the release before the supported floor stays out
    floor = {"torch": "2.5.1", "megatron-core": "0.13.1"}[dist]
    assert not spec.contains(floor, prereleases=True), f"{dist} {spec} accepts {floor}"


def test_bridge_and_its_gpu_stack_are_never_pulled(metadata: email.message.Message):
    """Every Bridge release requires Transformer Engine and mamba builds: no requirement, in any
    extra, may name them. Bridge stays whatever the container has, whatever version string it has."""
    pulled = {r.name for r in _requirements(metadata)} & GPU_STACK
    assert not pulled, f"the wheel requires {pulled}"
    bridge = [r.specifier for r in _requirements(metadata) if r.name == "megatron-bridge"]
    spec = SpecifierSet(",".join(str(b) for b in bridge))
    assert all(spec.contains(v) for v in NGC_VERSIONS["megatron-bridge"])


def _fake_wheel(dist: str, version: str, out: Path) -> Path:
    """A wheel holding nothing but the name and version: what pip's resolver reads of a container's
    torch or megatron-core."""
    tag = f"{dist.replace('-', '_')}-{version}"
    path = out / f"{tag}-py3-none-any.whl"
    info = f"{tag}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_install\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]))
    return path


@pytest.fixture(scope="session")
def ngc_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A venv with NGC-style torch and megatron-core, then ``pip install <our wheel>`` (real resolver)."""
    base = tmp_path_factory.mktemp("ngc")
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    fakes = [_fake_wheel(d, v, base) for d, v in FAKE.items()]
    proc = _run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, fakes)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _run([str(py), "-m", "pip", "install", "-q", str(wheel)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env_dir


def test_pip_install_keeps_the_containers_torch_and_core(ngc_venv: Path):
    # importlib.metadata gives the METADATA strings verbatim (pip list would normalise nv25.01 to nv25.1)
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({(d.metadata['Name'] or '').lower(): d.version for d in m.distributions()}))"
    )
    proc = _run([str(ngc_venv / "bin" / "python"), "-c", code])
    installed = json.loads(proc.stdout)
    for dist, version in FAKE.items():
        assert installed.get(dist) == version, f"pip changed {dist}: {installed.get(dist)}"
    assert "mbridge-mxfp8-plugin" in installed
    assert not set(installed) & GPU_STACK


def test_installed_console_script(ngc_venv: Path, metadata: email.message.Message, tmp_path: Path):
    """Outside any checkout: ``--version``, a shipped recipe by name, and doctor without a megatron-core
    to inspect (the stand-in has no files), each with the documented exit code and no traceback."""
    exe = str(ngc_venv / "bin" / "mxfp8-plugin")
    proc = _run([exe, "--version"], cwd=tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"mxfp8-plugin {metadata['Version']}")

    proc = _run([exe, "check", "tiny_debug_mxfp8"], cwd=tmp_path)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "mxfp8-plugin check tiny_debug_mxfp8" in proc.stdout

    proc = _run([exe, "doctor"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "megatron-core" in proc.stderr

    where = _run(
        [
            str(ngc_venv / "bin" / "python"),
            "-c",
            f"from {PACKAGE}.config.recipe_files import recipe_path;"
            "print(recipe_path('tiny_debug_mxfp8.yaml'))",
        ],
        cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(ngc_venv)
