"""Triton Python model: classification logits in, label names and softmax scores out."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        labels = json.loads(params["id2label"])
        self.labels = np.array([labels[str(i)] for i in range(len(labels))], dtype=object)

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy().astype(np.float64)
            shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probabilities = shifted / shifted.sum(axis=-1, keepdims=True)
            best = probabilities.argmax(axis=-1)
            label = self.labels[best].astype(object)
            score = probabilities.max(axis=-1).astype(np.float32)
            if logits.ndim == 2:  # one label per text: [batch, 1]
                label, score = label[:, None], score[:, None]
            label = np.vectorize(lambda s: s.encode("utf-8"), otypes=[object])(label)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("label", label), pb_utils.Tensor("score", score)]))
        return responses
