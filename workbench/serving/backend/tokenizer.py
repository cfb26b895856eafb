"""Triton Python model: UTF-8 text in, the model's int64 token tensors out (plus a per-text `truncated` flag)."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).parent))
from text_input import Limits, Prompts, TextEncoder, decode  # noqa: E402  (copied beside this file)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.max_length = int(params["max_length"])
        self.pad_to = sorted(int(edge) for edge in params.get("pad_to", "").split(",") if edge)
        self.names = [out["name"] for out in config["output"] if out["name"] != "truncated"]
        self.encoder = TextEncoder(Path(args["model_repository"]) / args["model_version"], self.max_length,
                                   self.names)
        self.pad_token_id = int(params.get("pad_token_id", "0"))
        self.prompts = Prompts(params)
        self.limits = Limits.of(params)

    def tokenize(self, texts, prompt):
        """Truncate to max_length, pad to the longest text, then up to the next `pad_to` edge if one is set
        (equal shapes let Triton's dynamic batcher put requests of one length bucket together)."""
        parts, flags = self.encoder.encode(texts, [prompt] * len(texts))
        width = max(part["input_ids"].shape[1] for part in parts)
        target = next((edge for edge in self.pad_to if edge >= width), width)
        fill = {"input_ids": self.pad_token_id}
        tensors = [pb_utils.Tensor(name, np.concatenate([
            np.pad(part[name], ((0, 0), (0, target - part[name].shape[1])), constant_values=fill.get(name, 0))
            for part in parts])) for name in self.names]
        truncated = np.array([[flag] for flag in flags])
        if truncated.any():
            pb_utils.Logger.log_warn(f"truncated {int(truncated.sum())} text(s) to {self.max_length} tokens")
        return pb_utils.InferenceResponse(output_tensors=tensors + [pb_utils.Tensor("truncated", truncated)])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts, prompt = self.prompts.apply(
                    decode(pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy(), limits=self.limits),
                    request.parameters())
                responses.append(self.tokenize(texts, prompt))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
        return responses
