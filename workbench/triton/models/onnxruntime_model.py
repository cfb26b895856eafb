"""Triton Python model running an ONNX file with onnxruntime (for Triton builds without the onnxruntime backend).

Requests of different lengths arrive together (ragged batching): they are right-padded to the longest, run as one
batch, and split back, per-token outputs trimmed to each request's own length.
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
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.per_token = {o["name"] for o in config["output"] if len(o["dims"]) >= 2}
        self.fill = {"input_ids": int(params.get("pad_token_id", "0"))}

    def execute(self, requests):
        arrays = [{name: pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in self.inputs}
                  for r in requests]
        longest = max(a["input_ids"].shape[1] for a in arrays)
        feed = {name: np.concatenate([np.pad(a[name], ((0, 0), (0, longest - a[name].shape[1])),
                                             constant_values=self.fill.get(name, 0)) for a in arrays])
                for name in self.inputs}
        results = dict(zip(self.outputs, self.session.run(None, feed)))
        responses, start = [], 0
        for a in arrays:
            rows, length = a["input_ids"].shape
            tensors = []
            for name, value in results.items():
                part = value[start:start + rows]
                if name in self.per_token:
                    part = part[:, :length]
                tensors.append(pb_utils.Tensor(name, np.ascontiguousarray(part)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += rows
        return responses
