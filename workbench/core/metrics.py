"""The base of every table a step records (run.json `metrics.<step>` and what nests in it): a pydantic model that
dumps as run.json holds it and shows itself as a table in a notebook. Apart from `results`, so the step registry can
name it without importing the configuration."""
from __future__ import annotations

import html
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict

Json = dict[str, Any]  # a nested table as recorded (measurement cells, per-text diagnostics)


class Metrics(BaseModel):
    """A step's metrics: every key declared (a misspelt or undeclared one is refused where it is written; older
    records lose theirs in `results.migrate`)."""

    model_config = ConfigDict(extra="forbid")

    def recorded(self) -> Json:
        """The metrics as run.json holds them (no defaults filled in; non-finite errors stay non-finite)."""
        return self.model_dump(exclude_unset=True, by_alias=True)

    def _repr_html_(self) -> str:
        """A notebook shows the metrics as a table: one row per field recorded, nested tables for nested ones."""
        return f"<b>{type(self).__name__}</b>{_html_table(self.recorded())}"


def _html_table(value: object) -> str:
    """`value` (as run.json holds it) as nested HTML tables; a list of plain values on one line."""
    if isinstance(value, dict):
        rows = "".join(f'<tr><th style="text-align: left; vertical-align: top">{html.escape(str(key))}</th>'
                       f'<td style="text-align: left">{_html_table(item)}</td></tr>' for key, item in value.items())
        return f"<table>{rows}</table>"
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return "".join(_html_table(item) for item in value)
    if isinstance(value, list):
        return html.escape(", ".join(map(str, value)))
    return html.escape(f"{value:.4g}" if isinstance(value, float) else str(value))


def declared_only(model: type[BaseModel], table: object) -> object:
    """`table` as `model` declares it: the keys it does not declare dropped, at every depth where a declared field
    holds another model (alone, optional, in a list or a mapping). What an older record's tables are migrated to,
    so they load under models that refuse undeclared keys."""
    if not isinstance(table, dict):
        return table
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    fields.update(model.model_fields)
    return {key: _declared_in(fields[key].annotation, value) for key, value in table.items() if key in fields}


def _declared_in(annotation: object, value: object) -> object:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return declared_only(annotation, value)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        return declared_only(models[0], value) if models and isinstance(value, dict) else value
    if origin is list and isinstance(value, list):
        return [_declared_in(args[0], item) for item in value]
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return {key: _declared_in(args[1], item) for key, item in value.items()}
    return value
