"""What the benchmark scripts beside it share and the tests check: the peers (Optimum, OpenVINO, Infinity, TEI),
their graphs timed beside the workbench's, and the checks of the resulting tables. Benchmark-only: the workbench
package imports none of it. The scripts import it as `peerlib` (their own folder is first on sys.path); the tests
too (pyproject's pytest `pythonpath`)."""
