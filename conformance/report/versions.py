"""The software a report records: the kit's, SGLang's (an installed release, or the source
checkout a ``--sglang-source`` re-run names in :data:`SOURCE_ENV`), torch's, transformers'
and Python's versions, read without importing them."""

from __future__ import annotations

import os
import sys
import warnings
from importlib import metadata

from conformance import __version__

SOURCE_ENV = "HYBRID_CONFORMANCE_SGLANG_SOURCE"  # "<path>@<commit>" inside a --sglang-source re-run


def recorded() -> dict[str, str] | None:
    """The checkout this process runs against ({"path", "commit"}), None for an installed release."""
    value = os.environ.get(SOURCE_ENV)
    if not value or "@" not in value:
        return None
    path, _, commit = value.rpartition("@")
    return {"path": path, "commit": commit}


def versions() -> dict[str, str | None]:
    """The versions a report records: kit, SGLang, torch, transformers, Python (no imports)."""
    def v(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {
            "kit": __version__,
            "sglang": v("sglang"),
            "torch": v("torch"),
            "transformers": v("transformers"),
            "python": sys.version.split()[0],
        }
    source = recorded()
    if source:
        out["sglang_source"], out["sglang_commit"] = source["path"], source["commit"]
    return out
