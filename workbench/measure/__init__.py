"""Speed: the in-process latency grid, ONNX Runtime session settings, load generators (perf_analyzer and asyncio)
and served sweeps."""
