"""Pipeline steps: one module per step, named as in `workbench.steplist`."""
