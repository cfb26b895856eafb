"""The ground floor: the run configuration and its record, typed errors, atomic files, the corpus and its batches,
the task registry, machine facts, timing and progress. Imports nothing else of the workbench."""
