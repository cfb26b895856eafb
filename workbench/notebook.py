"""What every step notebook does first: turn papermill parameters into a config and an open record."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from workbench.config import RunConfig
from workbench.record import RunRecord

INTERACTIVE_ROOT = Path(__file__).resolve().parent.parent / "outputs"


def start(config: dict[str, Any] | None, run_dir: str | None) -> tuple[RunConfig, RunRecord]:
    """Validate the parameters and open the run; interactive runs share outputs/interactive-<model>/."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    cfg = RunConfig.from_dict(config)
    folder = Path(run_dir) if run_dir else INTERACTIVE_ROOT / f"interactive-{cfg.model_slug}"
    return cfg, RunRecord.open(folder, cfg)
