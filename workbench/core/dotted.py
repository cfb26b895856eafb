"""Nested mappings addressed by dotted keys (`batch.max`, `parity.variants.fp32`): the one way the configuration's
overrides, the notebooks' parameters and the record's metrics are read and written."""
from __future__ import annotations

from typing import Any

from workbench.core.errors import ConfigError

_MISSING = object()


def get(data: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """The value at `dotted`, or `default` where a key is missing or a value on the way is no mapping."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def put(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` to `value`, creating the mappings on the way; a value on the way that is no mapping is a
    ConfigError naming the key."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"key {dotted!r} descends into a non-mapping", f"check the key {dotted!r}")
    node[leaf] = value


def pop(data: dict[str, Any], dotted: str) -> None:
    """Remove the value at `dotted`, and the mappings it leaves empty."""
    head, _, rest = dotted.partition(".")
    if rest and isinstance(data.get(head), dict):
        pop(data[head], rest)
        if not data[head]:
            del data[head]
    elif not rest:
        data.pop(head, None)
