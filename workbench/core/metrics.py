"""The base of every table a step records (run.json `metrics.<step>` and what nests in it): a pydantic model that
dumps as run.json holds it and shows itself as a table in a notebook. Apart from `results`, so the step catalog can
name it without importing the configuration."""
from __future__ import annotations

import html
from typing import Any

from pydantic import BaseModel, ConfigDict

Json = dict[str, Any]  # a nested table as recorded (measurement cells, per-text diagnostics)


class Metrics(BaseModel):
    """A step's metrics; fields not declared are kept as recorded."""

    model_config = ConfigDict(extra="allow")

    def recorded(self) -> Json:
        """The metrics as run.json holds them (no defaults filled in; non-finite errors stay non-finite)."""
        return self.model_dump(exclude_unset=True)

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
