"""Is the distbelief the tests import the wheel built from this tree?

The suite tests what users install: the wheel, installed (never editable) into the test
environment by `make test`. A tree changed since that install, or an install that
reaches the source folders, would test something else; mismatches() names what differs.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
from pathlib import Path

# Where each part of the installed package comes from in the tree.
SOURCES = {"distbelief/operator/crds/": "crds/", "distbelief/operator/": "operator/distbelief/operator/",
           "distbelief/runtime/": "runtime/distbelief/runtime/"}


def _record_hash(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def source_files(repo: Path) -> dict[str, str]:
    """The tree's package files, by their path in the wheel, with their RECORD hash."""
    found = {}
    for installed, folder in SOURCES.items():
        for path in (repo / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".yaml", ".gz") and "__pycache__" not in path.parts:
                found[installed + path.relative_to(repo / folder).as_posix()] = _record_hash(path)
    return found


def installed_files() -> dict[str, str]:
    dist = importlib.metadata.distribution("distbelief")
    return {str(f): f.hash.value for f in dist.files or () if f.hash and str(f).startswith("distbelief/")
            and "__pycache__" not in str(f)}


def mismatches(repo: Path) -> list[str]:
    """Why the installed distbelief is not the wheel of this tree; empty when it is."""
    try:
        dist = importlib.metadata.distribution("distbelief")
    except importlib.metadata.PackageNotFoundError:
        return ["distbelief is not installed"]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        return ["distbelief is installed editable: the tests would import the source folders"]
    import distbelief.runtime

    where = Path(distbelief.runtime.__file__).resolve()
    site = Path(str(dist.locate_file(""))).resolve()
    if site not in where.parents:
        return [f"distbelief.runtime is imported from {where}, not from the installed wheel in {site}"]
    source, installed = source_files(repo), installed_files()
    problems = [f"not in the installed wheel: {p}" for p in sorted(source.keys() - installed.keys())]
    problems += [f"installed but not in the tree: {p}" for p in sorted(installed.keys() - source.keys())]
    problems += [f"changed since it was installed: {p}" for p in sorted(source.keys() & installed.keys())
                 if source[p] != installed[p]]
    return problems
