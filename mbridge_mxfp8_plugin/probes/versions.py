"""Installed distribution versions, for messages only (decisions come from probed behaviour)."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

__all__ = ["installed_version", "installed_versions"]

_DISTS = ("torch", "megatron-core", "megatron-bridge", "lightning", "transformer-engine")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


@functools.lru_cache(maxsize=1)
def _scan() -> dict[str, str | None]:
    wanted = {_norm(d): d for d in _DISTS}
    out: dict[str, str | None] = dict.fromkeys(_DISTS)
    for entry in sys.path:
        try:
            names = [p.name for p in Path(entry or ".").iterdir() if p.name.endswith(".dist-info")]
        except OSError:
            continue
        for name in names:
            dist, _, version = name[: -len(".dist-info")].partition("-")
            key = wanted.get(_norm(dist))
            if key is not None and out[key] is None:
                out[key] = version
    return out


def installed_versions() -> dict[str, str | None]:
    """torch / megatron-core / Bridge / Lightning / TE versions from the ``*.dist-info`` names on
    ``sys.path``: what ``importlib.metadata.version`` answers (first match on the path wins),
    without its ~0.1 s import (``check`` has a one-second budget)."""
    return dict(_scan())


def installed_version(dist: str) -> str | None:
    return _scan().get(dist)
