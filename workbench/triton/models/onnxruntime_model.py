"""Triton Python model running an ONNX file with onnxruntime (for Triton builds without the onnxruntime backend).

Requests of different lengths arrive together (ragged batching). Padding them all to the longest would waste most
of the compute on a CPU (a batch of short texts padded to one long one), so they are sorted by length and cut into
groups whose padding stays under `max_padding` of the group's token slots; each group runs as one padded batch and is
split back, per-token outputs trimmed to each request's own length.
"""
import json
from pathlib import Path

import numpy as np
import onnxruntime
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        options = onnxruntime.SessionOptions()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # leave the CPU to the tokenizer
        if int(params.get("intra_op_threads", "0")):
            options.intra_op_num_threads = int(params["intra_op_threads"])
        path = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        providers = params.get("providers", "CPUExecutionProvider").split(",")
        self.session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=providers)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o["name"] for o in config["output"]]  # the outputs served, a subset of the graph's
        self.per_token = {o["name"] for o in config["output"] if len(o["dims"]) >= 2}
        self.fill = {"input_ids": int(params.get("pad_token_id", "0"))}
        self.max_padding = float(params.get("max_padding", "0.25"))

    def groups(self, arrays):
        """Request indices sorted by length, cut where padding would pass max_padding of the group's slots."""
        order = sorted(range(len(arrays)), key=lambda i: arrays[i]["input_ids"].shape[1])
        groups, current, real = [], [], 0
        for index in order:
            rows, length = arrays[index]["input_ids"].shape
            members = sum(arrays[i]["input_ids"].shape[0] for i in current) + rows
            if current and 1 - (real + rows * length) / (members * length) > self.max_padding:
                groups.append(current)
                current, real = [], 0
            current.append(index)
            real += rows * length
        return groups + [current]

    def run(self, arrays):
        longest = max(a["input_ids"].shape[1] for a in arrays)
        feed = {name: np.concatenate([np.pad(a[name], ((0, 0), (0, longest - a[name].shape[1])),
                                             constant_values=self.fill.get(name, 0)) for a in arrays])
                for name in self.inputs}
        results = dict(zip(self.outputs, self.session.run(self.outputs, feed)))
        parts, start = [], 0
        for a in arrays:
            rows, length = a["input_ids"].shape
            parts.append({name: value[start:start + rows, :length] if name in self.per_token
                          else value[start:start + rows] for name, value in results.items()})
            start += rows
        return parts

    def execute(self, requests):
        arrays = [{name: pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in self.inputs}
                  for r in requests]
        outputs = [None] * len(arrays)
        for group in self.groups(arrays):
            for index, part in zip(group, self.run([arrays[i] for i in group])):
                outputs[index] = part
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(value))
                                                           for name, value in part.items()]) for part in outputs]
