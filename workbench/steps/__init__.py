"""Pipeline steps: one module per step, named as in `workbench.core.steplist`."""
