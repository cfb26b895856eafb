"""ONNX Runtime over parts of different lengths (requests, or single texts) without padding them all to the longest:
sorted by length and cut into groups whose padding stays under `max_padding` of the group's token slots, each group
run as one padded batch and split back, per-token outputs trimmed to each part's own length (padding most of a
batch of short texts up to one long text wastes most of a CPU's work). Where the model's instances share the
CPU's cores, an instance whose neighbours are idle runs a second session with all of their threads (`Neighbours`).
Copied beside the Python models that run ONNX Runtime."""
import fcntl
import hashlib
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime

MAX_PADDING = 0.25  # a group's share of padded token slots past which the next, longer part starts a new group


def model_args(args):
    """What Triton passes `initialize`, unpacked: the model config, its string parameters, the version folder."""
    config = json.loads(args["model_config"])
    params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
    return config, params, Path(args["model_repository"]) / args["model_version"]


# How OpenVINO compiles the graph (as runners/openvino.py does in process): one stream, threads not pinned, at the
# inference precision the model config names (`openvino_precision`, the file's; f32 unless it says bf16).
OPENVINO_CONFIG = {"NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}


class OpenVinoSession:
    """The graph compiled by OpenVINO for the CPU behind the two calls PaddedRunner makes of a session (`get_inputs`,
    `run`): at `precision` ("f32" or "bf16"), one stream, `threads` inference threads, not pinned (the instances and
    the tokenizer share the cores), one infer request reused."""

    class Input:
        def __init__(self, name):
            self.name = name

    def __init__(self, path, threads, precision="f32"):
        import openvino

        config = {**OPENVINO_CONFIG, "INFERENCE_PRECISION_HINT": precision,
                  **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
        self.compiled = openvino.Core().compile_model(str(path), "CPU", config)
        self.request = self.compiled.create_infer_request()

    def get_inputs(self):
        return [self.Input(port.get_any_name()) for port in self.compiled.inputs]

    def run(self, outputs, feed):
        results = self.request.infer(feed)
        return [np.array(results[name]) for name in outputs]


def session(path, params, threads=None):
    """A session on the model's providers (OpenVINO where `runtime` says so); `threads` (else `intra_op_threads`; 0:
    the runtime's default) intra-op threads that sleep when idle, leaving the CPU to the tokenizer and the other
    instances; without the graph optimizers the file's form leaves out (`disabled_optimizers`)."""
    threads = threads or int(params.get("intra_op_threads", "0"))
    if params.get("runtime") == "openvino":
        return OpenVinoSession(path, threads, params.get("openvino_precision", "f32"))
    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    providers = params.get("providers", "CPUExecutionProvider").split(",")
    disabled = [name for name in params.get("disabled_optimizers", "").split(",") if name]
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers,
                                        disabled_optimizers=disabled)


def instances_folder(version_folder):
    """Where the instances of one model version keep their locks (`Neighbours`): under the temporary folder, never
    in the repository, named after the version folder's path."""
    key = hashlib.sha1(str(Path(version_folder).resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"workbench-instances-{key}"


class Neighbours:
    """Whether the model's other instances are executing now. Each instance holds an exclusive lock (flock) on a
    file of its own while it executes, in a folder the instances of one model version share (under the temporary
    folder, never in the repository); another instance tries those locks without waiting. Both take their own
    lock before they look, so two instances never both find the other idle."""

    def __init__(self, version_folder, instance, count):
        self.folder = instances_folder(version_folder)
        self.folder.mkdir(exist_ok=True)
        self.path = self.folder / f"{instance}.lock"
        self.mine = open(self.path, "w")
        self.count, self.others = count, {}

    @contextmanager
    def executing(self):
        fcntl.flock(self.mine, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.mine, fcntl.LOCK_UN)

    def busy(self):
        if len(self.others) < self.count - 1:  # instances start one after another: look again until all are here
            for path in self.folder.glob("*.lock"):
                if path != self.path and path not in self.others:
                    self.others[path] = open(path, "a")
        for handle in self.others.values():
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
        return False

    def close(self):
        for handle in (self.mine, *self.others.values()):
            handle.close()
        self.path.unlink(missing_ok=True)
        try:
            self.folder.rmdir()  # the last instance to go takes the folder with it
        except OSError:
            pass


def sessions(path, params, args):
    """The instance's session and, where `wide_threads` says the instances share more cores than it has, a second
    one with all of them and the Neighbours that tell when to use it: (session, wide session or None, Neighbours
    or None)."""
    narrow = session(path, params)
    wide_threads = int(params.get("wide_threads", "0"))
    if wide_threads <= int(params.get("intra_op_threads", "0")):
        return narrow, None, None
    neighbours = Neighbours(Path(path).parent, args["model_instance_name"], int(params["instances"]))
    return narrow, session(path, params, wide_threads), neighbours


def length_groups(shapes, max_padding, max_tokens=0):
    """Indices of `shapes` ((rows, length) per part) sorted by length, cut where padding would pass max_padding or
    the group's padded tokens `max_tokens` (0: no bound; a part alone may pass it: `PaddedRunner.run` cuts parts)."""
    order = sorted(range(len(shapes)), key=lambda i: shapes[i][1])
    groups, current, real, rows_in = [], [], 0, 0
    for index in order:
        rows, length = shapes[index]
        if current and (1 - (real + rows * length) / ((rows_in + rows) * length) > max_padding
                        or max_tokens and (rows_in + rows) * length > max_tokens):
            groups.append(current)
            current, real, rows_in = [], 0, 0
        current.append(index)
        real += rows * length
        rows_in += rows
    return groups + [current]


class PaddedRunner:
    """Runs `outputs` of a session over parts {input name: int64 [rows, length]}, one padded batch per group."""

    def __init__(self, session, outputs, per_token, pad_token_id, max_padding, wide=None, neighbours=None,
                 max_tokens=0):
        self.session, self.narrow, self.wide, self.neighbours = session, session, wide, neighbours
        self.inputs = [i.name for i in session.get_inputs()]
        self.outputs, self.per_token = list(outputs), set(per_token)
        self.fill = {"input_ids": pad_token_id}
        self.max_padding, self.max_tokens = max_padding, max_tokens

    def run_group(self, parts):
        longest = max(p["input_ids"].shape[1] for p in parts)
        feed = {name: np.concatenate([np.pad(p[name], ((0, 0), (0, longest - p[name].shape[1])),
                                             constant_values=self.fill.get(name, 0)) for p in parts])
                for name in self.inputs}
        results = dict(zip(self.outputs, self.session.run(self.outputs, feed)))
        split, start = [], 0
        for part in parts:
            rows, length = part["input_ids"].shape
            split.append({name: value[start:start + rows, :length] if name in self.per_token
                          else value[start:start + rows] for name, value in results.items()})
            start += rows
        return split

    @contextmanager
    def executing(self):
        """Around an `execute`: it counts as busy for the other instances, and runs on the wide session when none of
        them is busy."""
        if self.neighbours is None:
            yield
            return
        with self.neighbours.executing():
            self.session = self.narrow if self.neighbours.busy() else self.wide
            yield

    def run(self, parts):
        """Each part's outputs, in the parts' order; a part past `max_tokens` padded tokens runs in pieces of rows
        within it (one row at least), its outputs joined."""
        pieces, owners = [], []
        for index, part in enumerate(parts):
            rows, length = part["input_ids"].shape
            step = max(1, self.max_tokens // length) if self.max_tokens else rows
            for start in range(0, rows, step):
                pieces.append({name: value[start:start + step] for name, value in part.items()})
                owners.append(index)
        results = [None] * len(pieces)
        for group in length_groups([p["input_ids"].shape for p in pieces], self.max_padding, self.max_tokens):
            for index, result in zip(group, self.run_group([pieces[i] for i in group])):
                results[index] = result
        joined = [[] for _ in parts]
        for owner, result in zip(owners, results):
            joined[owner].append(result)
        return [found[0] if len(found) == 1 else {name: np.concatenate([r[name] for r in found])
                                                  for name in found[0]} for found in joined]
