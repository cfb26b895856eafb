"""Version pins, read from the installed project's metadata so that pyproject.toml stays the one place they live."""
from __future__ import annotations

import re
from functools import lru_cache
from importlib import metadata

PROJECT = "transformer-workbench"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@lru_cache(maxsize=1)
def _requirements() -> dict[str, str]:
    """{normalized name: requirement without its environment marker} over the dependencies and every extra."""
    found = {}
    for requirement in metadata.requires(PROJECT) or []:
        spec = requirement.split(";", 1)[0].strip()  # `<name>==<version>; extra == "cpu"` -> `<name>==<version>`
        found[_normalized(re.split(r"[\s\[<>=!~;@(]", spec, maxsplit=1)[0])] = spec
    return found


def pin(name: str) -> str:
    """The requirement pyproject.toml gives for `name` (a dependency or an extra's): `transformers==<its pin>`.

    Without the project installed (no metadata to read) it is the bare name."""
    try:
        requirements = _requirements()
    except metadata.PackageNotFoundError:
        return name
    try:
        return requirements[_normalized(name)]
    except KeyError:
        raise KeyError(f"{name} is not a requirement of {PROJECT} (pyproject.toml)") from None


def project_version() -> str:
    """The installed workbench's version (pyproject.toml's, through the distribution metadata)."""
    try:
        return metadata.version(PROJECT)
    except metadata.PackageNotFoundError:
        return f"unknown ({PROJECT} is not installed: pip install -e .)"
