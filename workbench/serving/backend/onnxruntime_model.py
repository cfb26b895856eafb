"""Triton Python model running an ONNX file with onnxruntime (for Triton builds without the onnxruntime backend).
Requests of different lengths arrive together (ragged batching) and run in length groups (ort_batches.py)."""
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).parent))
from ort_batches import MAX_PADDING, PaddedRunner, model_args, sessions  # noqa: E402  (copied beside this file)


class TritonPythonModel:
    def initialize(self, args):
        config, params, folder = model_args(args)
        model, wide, self.neighbours = sessions(folder / "model.onnx", params, args)
        self.inputs = [i.name for i in model.get_inputs()]
        outputs = [o["name"] for o in config["output"]]  # the outputs served, a subset of the graph's
        per_token = [o["name"] for o in config["output"] if len(o["dims"]) >= 2]
        self.runner = PaddedRunner(model, outputs, per_token, int(params.get("pad_token_id", "0")),
                                   float(params.get("max_padding", MAX_PADDING)), wide, self.neighbours,
                                   int(params.get("max_tokens", "0")))

    def finalize(self):
        if self.neighbours is not None:
            self.neighbours.close()

    def execute(self, requests):
        parts = [{name: pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in self.inputs}
                 for r in requests]
        with self.runner.executing():
            results = self.runner.run(parts)
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(value))
                                                           for name, value in result.items()])
                for result in results]
