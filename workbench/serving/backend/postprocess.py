"""Triton Python model: classification logits in, label names and scores out (the head as labels.py applies it)."""
import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).parent))
from labels import label_and_score, label_names  # noqa: E402  (copied beside this file)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.labels = label_names(json.loads(params["id2label"]))
        self.activation = params["activation"]

    def execute(self, requests):
        responses = []
        for request in requests:
            label, score = label_and_score(pb_utils.get_input_tensor_by_name(request, "logits").as_numpy(),
                                           self.labels, self.activation)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("label", label), pb_utils.Tensor("score", score)]))
        return responses
