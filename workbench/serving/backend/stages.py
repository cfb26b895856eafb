"""Where a Python model's `execute` time goes, stage by stage, as Triton custom metrics on the server's metrics port:
`workbench_stage_seconds_total{model, stage}` and `workbench_executions_total{model}`. The sums are kept here and
sent at most every FLUSH_SECONDS (each increment is a message to the server process, too dear for every request), so
a reader dividing one by the other over a few seconds gets the mean per execution. Copied beside the Python models
that use it."""
import time

import triton_python_backend_utils as pb_utils

FLUSH_SECONDS = 0.5


class StageClock:
    """Lap times of `stages` per `execute` of `model` (start, lap after each stage, done)."""

    def __init__(self, model, stages):
        counter = pb_utils.MetricFamily.COUNTER
        self.seconds = pb_utils.MetricFamily(name="workbench_stage_seconds_total", kind=counter,
                                             description="Seconds a workbench Python model spent per stage of execute")
        self.executed = pb_utils.MetricFamily(name="workbench_executions_total", kind=counter,
                                              description="Executions timed in workbench_stage_seconds_total")
        # the families are held on self: a family must outlive its metrics
        self.metrics = {stage: self.seconds.Metric(labels={"model": model, "stage": stage}) for stage in stages}
        self.executions = self.executed.Metric(labels={"model": model})
        self.pending = dict.fromkeys(stages, 0.0)
        self.count, self.flushed, self.last = 0, time.monotonic(), 0.0

    def start(self):
        self.last = time.perf_counter()

    def lap(self, stage):
        now = time.perf_counter()
        self.pending[stage] += now - self.last
        self.last = now

    def done(self):
        self.count += 1
        if time.monotonic() - self.flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self):
        for stage, value in self.pending.items():
            self.metrics[stage].increment(value)
        self.executions.increment(self.count)
        self.pending = dict.fromkeys(self.pending, 0.0)
        self.count, self.flushed = 0, time.monotonic()
