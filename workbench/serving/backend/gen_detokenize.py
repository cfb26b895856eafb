"""Triton Python model: generated token ids in, text out."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
import generation_core as core  # noqa: E402  (copied beside this file)


class TritonPythonModel:
    def initialize(self, args):
        json.loads(args["model_config"])
        folder = Path(args["model_repository"]) / args["model_version"]
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "OUTPUT_IDS").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "OUTPUT_LENGTHS").as_numpy()
            texts = self.tokenizer.batch_decode(core.unpack(ids, lengths), skip_special_tokens=True)
            array = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT_TEXT", array)]))
        return responses
