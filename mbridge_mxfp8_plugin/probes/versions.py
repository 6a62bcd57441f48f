"""Installed versions, and where megatron-core and Megatron-Bridge come from (for messages only:
decisions come from probed behaviour).

Megatron-Bridge is being folded into Megatron-LM under ``megatron/bridge`` (Megatron-Bridge
#6172): the same import path may come from its own ``megatron-bridge`` distribution, from the
distribution that ships Megatron-LM (``megatron-core`` today), or from a source tree put on
``PYTHONPATH`` with no distribution at all. A version read from the ``megatron-bridge`` dist-info
alone would then say "not installed" for a Bridge that imports fine, or name a release whose code
is shadowed by another copy. So :func:`package_origin` starts from the directory
``import megatron.bridge`` would load and asks who owns it: the dist-info beside it whose
``RECORD`` lists it, an editable install pointing at it, or nobody (its ``package_info.py``).
Everything is read as text: ``check`` aims at 0.25 s a file (``benchmarks/check_speed.py``) and
must not import torch.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ..common.records import record
from ._source import megatron_subdir, read_text

__all__ = ["PackageOrigin", "installed_version", "installed_versions", "package_origin"]

_DISTS = ("torch", "megatron-core", "megatron-bridge", "lightning", "transformer-engine")
#: megatron sub-package -> the distribution that ships it on its own.
_OWN_DIST = {"core": "megatron-core", "bridge": "megatron-bridge"}


_SEPARATORS = str.maketrans("-.", "__")


def _norm(name: str) -> str:
    """PEP 503's name, ``_`` for its separator (a run of ``-_.`` is one), without a regex compile."""
    name = name.translate(_SEPARATORS).lower()
    while "__" in name:
        name = name.replace("__", "_")
    return name


def _dist_infos(entry: str | Path) -> list[tuple[str, str, Path]]:
    """``(normalised name, version, path)`` of every ``*.dist-info`` directly in ``entry``."""
    return _listed(os.fspath(entry or "."))


@functools.lru_cache(maxsize=16)
def _listed(folder: str) -> list[tuple[str, str, Path]]:
    """Memoized per folder, and names rather than ``Path.iterdir``: a site-packages holds hundreds
    of entries, and ``check`` asks of each ``sys.path`` entry once and of the one holding megatron
    again, on a budget of milliseconds (issue 30)."""
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".dist-info")]
    except OSError:
        return []
    out = []
    for name in names:
        dist, _, version = name[: -len(".dist-info")].partition("-")
        out.append((_norm(dist), version, Path(folder, name)))
    return out


@functools.lru_cache(maxsize=1)
def _scan() -> dict[str, tuple[str, Path]]:
    """First ``*.dist-info`` per distribution on ``sys.path``: what ``importlib.metadata`` finds."""
    out: dict[str, tuple[str, Path]] = {}
    for entry in sys.path:
        for name, version, path in _dist_infos(entry):
            out.setdefault(name, (version, path))
    return out


@record
class PackageOrigin:
    """Where ``megatron.<package>`` is imported from, and which release that is."""

    #: ``megatron.core`` / ``megatron.bridge``
    package: str
    #: the directory ``import megatron.<package>`` loads
    path: str
    #: the package's own release (its ``package_info.py``; the owning dist-info's when it is the
    #: package's own distribution, which is what pip reports, local tags included)
    version: str | None
    #: the distribution that installed it (``megatron-bridge``, ``megatron-core``, ...), or None
    #: for a source tree on ``sys.path``
    distribution: str | None = None
    distribution_version: str | None = None
    #: installed with ``pip install -e`` (the dist-info points at this source tree)
    editable: bool = False

    def describe(self) -> str:
        """One phrase: ``0.7.0 (megatron-bridge distribution)``, ``0.7.0 (inside the megatron-core
        0.20.0 distribution)``, ``0.7.0 (source tree /x, no distribution)``."""
        version = self.version or "unknown version"
        if self.distribution is None:
            return f"{version} (source tree {self.path}, no distribution)"
        how = "editable " if self.editable else ""
        if self.distribution == _OWN_DIST.get(self.package.rpartition(".")[2]):
            return f"{version} ({how}{self.distribution} distribution)"
        return f"{version} (inside the {how}{self.distribution} {self.distribution_version} distribution)"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_INFO_FIELDS = ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")


def _package_info_version(pkg_dir: Path) -> str | None:
    """``MAJOR.MINOR.PATCH`` + ``PRE_RELEASE`` from the package's ``package_info.py`` (the form
    megatron-core and Megatron-Bridge both use); a literal ``__version__`` otherwise."""
    text = read_text(pkg_dir, "package_info.py")
    found: dict[str, str] = {}
    for field in re.finditer(rf"^({'|'.join(_INFO_FIELDS)})\s*=\s*(?:(\d+)|['\"]([^'\"]*)['\"])", text, re.M):
        found.setdefault(field.group(1), field.group(2) if field.group(2) is not None else field.group(3))
    if all(f in found for f in _INFO_FIELDS[:3]):
        return ".".join(found[f] for f in _INFO_FIELDS[:3]) + found.get("PRE_RELEASE", "")
    m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None


def _records(dist_info: Path, rel: str) -> bool:
    """The dist-info's ``RECORD`` lists ``rel`` (a file it installed)."""
    record = read_text(dist_info, "RECORD")
    return record.startswith(rel + ",") or f"\n{rel}," in record


def _editable_owner(pkg_dir: Path) -> tuple[str, str] | None:
    """An editable install (``direct_url.json`` with ``editable``) whose project holds ``pkg_dir``."""
    for name, (version, path) in _scan().items():
        if not name.startswith("megatron"):
            continue
        try:
            import json  # an editable install only

            info = json.loads(read_text(path, "direct_url.json") or "{}")
        except ValueError:
            continue
        url = urlparse(info.get("url", ""))
        if info.get("dir_info", {}).get("editable") and url.scheme == "file":
            project = Path(unquote(url.path))
            if pkg_dir.resolve().is_relative_to(project.resolve()):
                return name.replace("_", "-"), version
    return None


@functools.lru_cache(maxsize=4)
def package_origin(package: str) -> PackageOrigin | None:
    """Where ``megatron.<package>`` (``core`` or ``bridge``) comes from; None when it is absent.

    Found without importing it (the first ``megatron/<package>/__init__.py`` on the namespace
    path, the copy Python would load). Its owner is the dist-info in the same ``sys.path`` entry
    whose ``RECORD`` lists that ``__init__.py`` (the package's own distribution is tried first),
    else an editable install of a project that contains it, else none (a source tree).
    """
    pkg_dir = megatron_subdir(package, "__init__.py")
    if pkg_dir is None:
        return None
    own = _OWN_DIST.get(package)
    info_version = _package_info_version(pkg_dir)
    rel = f"megatron/{package}/__init__.py"
    beside = sorted(
        (d for d in _dist_infos(pkg_dir.parent.parent) if d[0].startswith("megatron")),
        key=lambda d: d[0] != _norm(own or ""),
    )
    owner = next(((n.replace("_", "-"), v) for n, v, p in beside if _records(p, rel)), None)
    editable = False
    if owner is None:
        owner = _editable_owner(pkg_dir)
        editable = owner is not None
    if owner is None:
        return PackageOrigin(f"megatron.{package}", str(pkg_dir), info_version)
    dist, dist_version = owner
    version = dist_version if dist == own else (info_version or dist_version)
    return PackageOrigin(f"megatron.{package}", str(pkg_dir), version, dist, dist_version, editable)


def installed_versions() -> dict[str, str | None]:
    """torch / megatron-core / Bridge / Lightning / TE versions, without importing any of them.

    megatron-core and Megatron-Bridge: the release of the copy ``import megatron.core`` /
    ``import megatron.bridge`` would load (:func:`package_origin`), wherever it came from. The
    others: the first ``*.dist-info`` on ``sys.path`` (what ``importlib.metadata.version``
    answers, without its ~0.1 s import).
    """
    out: dict[str, str | None] = {d: (_scan().get(_norm(d)) or (None,))[0] for d in _DISTS}
    for package, dist in _OWN_DIST.items():
        origin = package_origin(package)
        # No importable package: a dist-info left behind is not an installed release.
        out[dist] = origin.version if origin is not None else None
    return out


def installed_version(dist: str) -> str | None:
    return installed_versions().get(dist)


def _clear_caches() -> None:
    """For tests that rearrange ``sys.path``."""
    _scan.cache_clear()
    _listed.cache_clear()
    package_origin.cache_clear()
