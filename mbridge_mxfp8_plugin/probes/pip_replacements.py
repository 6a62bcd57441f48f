"""What ``pip install`` would replace here: the installed requirements judged by pip's own rule.

Why: NVIDIA's containers ship torch, megatron-core, Megatron-Bridge and Transformer Engine as
pre-release or local builds (``torch 2.6.0a0+ecf3bae40a.nv25.01``). When pip installs a wheel it
walks the requirements of every installed distribution it reaches from that wheel (the plugin ->
megatron-core -> torch, read from each one's installed ``METADATA``), keeps an installed version
only where every requirement on it accepts it, and otherwise installs an index release in its
place: megatron-core 0.16.1's ``torch>=2.6.0`` rejects ``2.6.0a0+...`` (a pre-release of 2.6.0
sorts below 2.6.0), so ``pip install <plugin wheel>`` swaps the container's CUDA torch for a PyPI
wheel, although the plugin's own bound (``torch>=2.6.0a0``) accepts it; the plugin's
``omegaconf<2.4`` rejects a container's ``2.4.0.dev3`` (``<V`` excludes V's own pre-releases).

pip's rule for an installed version (pip 23.2 and 26.3, ``resolution/resolvelib/factory.py``,
``_get_installed_candidate``): ``SpecifierSet.contains(version, prereleases=True)``. The rule
that keeps pre-releases out (no pre-release unless the specifier names one, or ``--pre``) is for
picking a new release from an index; an installed pre-release inside the range is kept
(``torch>=2.5`` keeps 2.6.0a0, as pip does in a resolver run). What stays outside the range is a
matter of ordering alone: ``2.6.0a0 < 2.6.0``, and a local label (``+nv25.01``) does not move a
version across a bound. Markers are evaluated for this interpreter, with the extras requested on
the way (``megatron-core[dev]`` walks core's ``dev`` requirements too).

Who is walked: from the plugin's own distribution, what ``pip install <plugin wheel>`` resolves;
from Megatron-Bridge's, what any install that resolves Bridge does (``pip install -U
megatron-bridge``; not the plugin's install, which does not require Bridge, so pip does not read
Bridge's requirements then). The judge says no more than it reads: a distribution whose metadata
is missing or unreadable, a requirement it cannot parse, and a requirement on a package that is
not installed (pip adds an index release, whose requirements are not here to read) make the
verdict ``unchecked``, with the reason, unless a replacement is already certain. Read with
``importlib.metadata`` and ``packaging``: nothing is imported, nothing is fetched.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

__all__ = [
    "PLUGIN_DIST",
    "PipVerdict",
    "Replacement",
    "is_container_build",
    "judge_install",
    "pip_replacements",
    "replaced_names",
]

#: the plugin's distribution name (pyproject.toml ``[project] name``)
PLUGIN_DIST = "mbridge-mxfp8-plugin"
#: the page with the install that keeps the container's builds
FIX = "pip install --no-deps <wheel>, then the missing pure-Python dependencies (docs/container.md)"

#: Distributions a CUDA container builds for its own CUDA, driver and NCCL: a PyPI wheel in their
#: place is another build (or a source build of TE, mamba, flash-attn), not an upgrade.
_CONTAINER_BUILDS = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "triton",
        "megatron-core",
        "megatron-bridge",
        "nemo-toolkit",
        "apex",
        "flash-attn",
        "mamba-ssm",
        "causal-conv1d",
    }
)
_CONTAINER_PREFIXES = ("transformer-engine", "nvidia-")


def _canon(name: str) -> str:
    """PEP 503 normalised name (what ``packaging.utils.canonicalize_name`` returns)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_container_build(name: str) -> bool:
    """torch, megatron-core, Megatron-Bridge, Transformer Engine (every ``transformer-engine*``
    wheel), the CUDA libraries (``nvidia-*``) and the other CUDA-compiled packages a container ships."""
    canon = _canon(name)
    return canon in _CONTAINER_BUILDS or canon.startswith(_CONTAINER_PREFIXES)


@dataclass(frozen=True)
class Replacement:
    """One installed package pip would replace, and the requirement that makes it."""

    #: the distribution pip would replace, as it names itself
    package: str
    #: its installed version, verbatim
    installed: str
    #: the requirement that rejects it (``torch>=2.6.0``)
    requirement: str
    #: who requires it (``megatron-core 0.16.1``)
    required_by: str
    #: the path pip takes to that requirement, from the root (``mbridge-mxfp8-plugin 0.1.0``, ...)
    via: tuple[str, ...]
    #: why the version is outside (a pre-release below its bound), or empty where it plainly is
    why: str = ""

    @property
    def container_build(self) -> bool:
        return is_container_build(self.package)

    def line(self) -> str:
        """``torch 2.6.0a0+...: megatron-core 0.16.1 requires torch>=2.6.0 (via ...); why``."""
        text = f"{self.package} {self.installed}: {self.required_by} requires {self.requirement}"
        if len(self.via) > 1:
            text += f" (via {' -> '.join(self.via)})"
        return f"{text}; {self.why}" if self.why else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"container_build": self.container_build, "line": self.line()}


@dataclass(frozen=True)
class PipVerdict:
    """What one install (``scope``) would do to the installed packages."""

    #: the distribution the walk starts from
    root: str
    #: its installed version (None: its metadata is not installed)
    root_version: str | None
    #: the install this judges, in the user's words
    scope: str
    replacements: tuple[Replacement, ...] = ()
    #: what could not be judged, each with its reason
    unchecked: tuple[str, ...] = ()
    #: required but not installed: pip adds an index release (its requirements are not read)
    added: tuple[str, ...] = ()
    #: requirements judged against an installed version
    checked: int = 0
    fix: str = FIX

    @property
    def status(self) -> str:
        """``replaces`` (certain), ``unchecked`` (nothing certain, something unread) or ``keeps``."""
        if self.replacements:
            return "replaces"
        return "unchecked" if self.unchecked or self.added else "keeps"

    def as_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "root_version": self.root_version,
            "scope": self.scope,
            "status": self.status,
            "replacements": [r.as_dict() for r in self.replacements],
            "unchecked": list(self.unchecked),
            "added": list(self.added),
            "checked": self.checked,
            "fix": self.fix if self.replacements else None,
        }


# --------------------------------------------------------------------------- reading the metadata
def _field_of(dist: metadata.Distribution, key: str) -> str | None:
    md = dist.metadata
    if md is None or key not in md:  # no METADATA file: an empty message (never raise, never warn)
        return None
    value = md[key]
    return value.strip() if isinstance(value, str) and value.strip() else None


def _path_name(dist: metadata.Distribution) -> str | None:
    """The name a ``*.dist-info`` directory carries, for one whose METADATA is unreadable."""
    name = getattr(dist, "_normalized_name", None)
    if isinstance(name, str) and name:
        return _canon(name)
    path = getattr(dist, "_path", None)
    stem = getattr(path, "name", "")
    return _canon(stem.split("-", 1)[0]) if stem else None


class _Index:
    """The installed distributions by normalised name, first on the path winning (what both
    ``importlib.metadata.distribution`` and pip see), and the ones whose metadata is broken."""

    def __init__(self, path: Sequence[str] | None) -> None:
        self.dists: dict[str, metadata.Distribution] = {}
        self.broken: dict[str, str] = {}
        found = metadata.distributions() if path is None else metadata.distributions(path=list(path))
        for dist in found:
            name = _field_of(dist, "Name")
            key = _canon(name) if name else _path_name(dist)
            if not key or key in self.dists or key in self.broken:
                continue
            if name is None or _field_of(dist, "Version") is None:
                where = getattr(dist, "_path", None) or key
                self.broken[key] = f"{key}: its installed metadata ({where}) has no Name or Version"
                continue
            self.dists[key] = dist

    def get(self, name: str) -> metadata.Distribution | None:
        return self.dists.get(_canon(name))


def _label(dist: metadata.Distribution) -> str:
    return f"{_field_of(dist, 'Name')} {_field_of(dist, 'Version')}"


# --------------------------------------------------------------------------- pip's rule
def _release(version: Any) -> tuple[int, ...]:
    """The release numbers without trailing zeros (2.4 and 2.4.0 are one release)."""
    release = tuple(version.release)
    while release and release[-1] == 0:
        release = release[:-1]
    return release


def _why(version: Any, text: str, specifier: Any) -> str:
    """The clause that rejects ``version`` and, for a pre-release or local build, why it does."""
    for spec in specifier:
        if spec.contains(version, prereleases=True):
            continue
        bound = spec.version.split("+")[0].removesuffix(".*")
        try:
            same_release = _release(version) == _release(type(version)(bound))
        except Exception:  # noqa: BLE001 - an odd bound (===, wildcards): no explanation, not wrong
            same_release = False
        if version.is_prerelease and same_release and spec.operator in (">=", ">", "==", "~="):
            return f"{text} is a pre-release of {version.base_version} and sorts below {bound}"
        if version.is_prerelease and same_release and spec.operator == "<":
            return f"{spec} excludes {bound}'s own pre-releases (PEP 440)"
        return f"not in {spec}"
    return ""


def _wanted(marker: Any, extra: str) -> bool | None:
    """Whether a requirement's marker holds here for ``extra`` ("" = the base requirements):
    only those that hold for this extra and not for the base (they are counted there)."""
    if marker is None:
        return extra == ""
    try:
        here = bool(marker.evaluate({"extra": extra}))
        base = bool(marker.evaluate({"extra": ""})) if extra else False
    except Exception:  # noqa: BLE001 - an unknown marker variable: unjudged, not skipped
        return None
    return here and not base


def judge_install(root: str, scope: str, path: Sequence[str] | None = None) -> PipVerdict:
    """Walk ``root``'s installed requirements as pip's resolver does and judge each against the
    installed version by pip's rule; ``path`` defaults to ``sys.path``."""
    return _judge(_Index(path), root, scope)


def _replacement(target: Any, installed: str, version: Any, req: Any, via: tuple[str, ...]) -> Replacement:
    """What pip would do to ``target`` for ``req``: replace it, and why in words."""
    return Replacement(
        package=_field_of(target, "Name") or req.name,
        installed=installed,
        requirement=f"{req.name}{req.specifier}",
        required_by=via[-1],
        via=via,
        why=_why(version, installed, req.specifier),
    )


def _judge(index: _Index, root: str, scope: str) -> PipVerdict:
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return PipVerdict(root, None, scope, unchecked=("packaging is not installed: nothing judged",))
    start = index.get(root)
    if start is None:
        reason = index.broken.get(_canon(root)) or f"{root} has no installed metadata (no .dist-info)"
        return PipVerdict(root, None, scope, unchecked=(f"{reason}: its requirements are unread",))
    replacements: dict[tuple[str, str, str], Replacement] = {}
    unchecked: list[str] = []
    added: list[str] = []
    checked = 0
    seen: set[tuple[str, str]] = set()
    queue: deque[tuple[metadata.Distribution, frozenset[str], tuple[str, ...]]] = deque(
        [(start, frozenset(), (_label(start),))]
    )
    while queue:
        dist, extras, via = queue.popleft()
        name = _canon(_field_of(dist, "Name") or "")
        for extra in ("", *sorted(extras)):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for text in dist.requires or ():
                try:
                    req = Requirement(text)
                except InvalidRequirement:
                    unchecked.append(f"{via[-1]}: cannot parse the requirement {text!r}")
                    continue
                wanted = _wanted(req.marker, extra)
                if wanted is None:
                    unchecked.append(f"{via[-1]}: cannot evaluate the marker of {text!r}")
                if not wanted:
                    continue
                target = index.get(req.name)
                if target is None:
                    broken = index.broken.get(_canon(req.name))
                    if broken:
                        unchecked.append(f"{broken} ({via[-1]} requires {req})")
                    elif _canon(req.name) not in added:
                        added.append(_canon(req.name))
                    continue
                if req.url:
                    unchecked.append(f"{via[-1]} requires {req}: a direct URL, which pip judges by the URL")
                    continue
                installed = _field_of(target, "Version") or ""
                try:
                    version = Version(installed)
                except InvalidVersion:
                    unchecked.append(f"{_label(target)}: not a PEP 440 version ({via[-1]} requires {req})")
                    continue
                checked += 1
                if req.specifier.contains(version, prereleases=True):
                    queue.append((target, frozenset(req.extras), (*via, _label(target))))
                    continue
                key = (_canon(req.name), str(req.specifier), via[-1])
                replacements.setdefault(key, _replacement(target, installed, version, req, via))
    # the container's CUDA builds first: those are the replacements that cost a working stack
    ordered = sorted(replacements.values(), key=lambda r: not r.container_build)
    return PipVerdict(
        root=root,
        root_version=_field_of(start, "Version"),
        scope=scope,
        replacements=tuple(ordered),
        unchecked=tuple(dict.fromkeys(unchecked)),
        added=tuple(sorted(added, key=lambda n: not is_container_build(n))),
        checked=checked,
    )


def pip_replacements(path: Sequence[str] | None = None) -> list[PipVerdict]:
    """The plugin's own install, then (where Bridge is installed) an install that resolves Bridge."""
    index = _Index(path)
    verdicts = [_judge(index, PLUGIN_DIST, "pip install <the plugin's wheel>")]
    if index.get("megatron-bridge") is not None or "megatron-bridge" in index.broken:
        scope = (
            "an install that resolves megatron-bridge (pip install -U megatron-bridge; not the "
            "plugin's, which does not require Bridge)"
        )
        verdicts.append(_judge(index, "megatron-bridge", scope))
    return verdicts


def replaced_names(replacements: Iterable[Replacement]) -> list[str]:
    """The replaced packages' names, once each, in order."""
    return list(dict.fromkeys(r.package for r in replacements))
