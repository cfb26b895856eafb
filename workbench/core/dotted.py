"""Nested mappings addressed by dotted keys (`batch.max`, `parity.variants.fp32`): the one way the configuration's
overrides, the notebooks' parameters and the record's metrics are read and written."""
from __future__ import annotations

from typing import Any

from workbench.core.errors import ConfigError

_MISSING = object()
Value = str | int | float | bool | None | list["Value"] | dict[str, "Value"]  # a setting as JSON holds it
Tree = dict[str, Value]  # a configuration or a record's table, nested


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


def flat(data: Tree, prefix: str = "") -> dict[str, Value]:
    """Every leaf of `data` under its dotted key (an empty mapping is a leaf)."""
    leaves: dict[str, Value] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            leaves.update(flat(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def changes(old: Tree, new: Tree) -> dict[str, tuple[Value, Value]]:
    """The dotted keys whose value differs between `old` and `new`, each with (old, new); None where absent."""
    before, after = flat(old), flat(new)
    return {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)}
