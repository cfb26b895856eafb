"""Where a Python model's `execute` time goes, stage by stage, as Triton custom metrics on the server's metrics port:
`workbench_stage_seconds_total{model, stage}` and `workbench_executions_total{model}`. Each instance keeps its sums
here and a thread of its own sends them every FLUSH_SECONDS (an increment is a message to the server process, too
dear for every request), traffic or not: a reader waiting FLUSH_SECONDS before each reading has every instance's
executions so far, and dividing one metric by the other gets the mean per execution. Copied beside the Python models
that use it."""
import threading
import time

import triton_python_backend_utils as pb_utils

FLUSH_SECONDS = 0.5


class StageClock:
    """Lap times of `stages` per `execute` of `model` (start, lap after each stage, done); `close` at finalize."""

    def __init__(self, model, stages):
        counter = pb_utils.MetricFamily.COUNTER
        self.seconds = pb_utils.MetricFamily(name="workbench_stage_seconds_total", kind=counter,
                                             description="Seconds a workbench Python model spent per stage of execute")
        self.executed = pb_utils.MetricFamily(name="workbench_executions_total", kind=counter,
                                              description="Executions timed in workbench_stage_seconds_total")
        # the families are held on self: a family must outlive its metrics
        self.metrics = {stage: self.seconds.Metric(labels={"model": model, "stage": stage}) for stage in stages}
        self.executions = self.executed.Metric(labels={"model": model})
        self.pending, self.count, self.last = dict.fromkeys(stages, 0.0), 0, 0.0
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.sender = threading.Thread(target=self._send_every_interval, daemon=True)
        self.sender.start()

    def start(self):
        self.last = time.perf_counter()

    def lap(self, stage):
        now = time.perf_counter()
        with self.lock:
            self.pending[stage] += now - self.last
        self.last = now

    def done(self):
        with self.lock:
            self.count += 1

    def flush(self):
        with self.lock:
            pending, count = self.pending, self.count
            self.pending, self.count = dict.fromkeys(pending, 0.0), 0
        if count:
            for stage, value in pending.items():
                self.metrics[stage].increment(value)
            self.executions.increment(count)

    def _send_every_interval(self):
        while not self.stopped.wait(FLUSH_SECONDS):
            self.flush()

    def close(self):
        self.stopped.set()
        self.sender.join()
        self.flush()
