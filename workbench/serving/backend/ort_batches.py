"""ONNX Runtime over parts of different lengths (requests, or single texts) without padding them all to the longest:
sorted by length and cut into groups whose padding stays under `max_padding` of the group's token slots, each group
run as one padded batch and split back, per-token outputs trimmed to each part's own length (padding most of a
batch of short texts up to one long text wastes most of a CPU's work). Copied beside the Python models that run
ONNX Runtime."""
import json
from pathlib import Path

import numpy as np
import onnxruntime


def model_args(args):
    """What Triton passes `initialize`, unpacked: the model config, its string parameters, the version folder."""
    config = json.loads(args["model_config"])
    params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
    return config, params, Path(args["model_repository"]) / args["model_version"]


def session(path, params):
    """A session on the model's providers; `intra_op_threads` (0: ONNX Runtime's default) threads that sleep when
    idle, leaving the CPU to the tokenizer and the other instances."""
    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if int(params.get("intra_op_threads", "0")):
        options.intra_op_num_threads = int(params["intra_op_threads"])
        options.inter_op_num_threads = 1
    providers = params.get("providers", "CPUExecutionProvider").split(",")
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers)


def length_groups(shapes, max_padding):
    """Indices of `shapes` ((rows, length) per part) sorted by length, cut where padding would pass max_padding."""
    order = sorted(range(len(shapes)), key=lambda i: shapes[i][1])
    groups, current, real, rows_in = [], [], 0, 0
    for index in order:
        rows, length = shapes[index]
        if current and 1 - (real + rows * length) / ((rows_in + rows) * length) > max_padding:
            groups.append(current)
            current, real, rows_in = [], 0, 0
        current.append(index)
        real += rows * length
        rows_in += rows
    return groups + [current]


class PaddedRunner:
    """Runs `outputs` of a session over parts {input name: int64 [rows, length]}, one padded batch per group."""

    def __init__(self, session, outputs, per_token, pad_token_id, max_padding):
        self.session = session
        self.inputs = [i.name for i in session.get_inputs()]
        self.outputs, self.per_token = list(outputs), set(per_token)
        self.fill = {"input_ids": pad_token_id}
        self.max_padding = max_padding

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

    def run(self, parts):
        """Each part's outputs, in the parts' order."""
        results = [None] * len(parts)
        for group in length_groups([p["input_ids"].shape for p in parts], self.max_padding):
            for index, result in zip(group, self.run_group([parts[i] for i in group])):
                results[index] = result
        return results
