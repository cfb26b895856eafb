"""Triton Python model: texts (and an optional target language) in, source token ids out, for generation."""
import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
import generation_core as core  # noqa: E402  (copied beside this file)
from text_input import decode  # noqa: E402


def optional_string(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None or tensor.as_numpy().size == 0:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return (value.decode("utf-8") if isinstance(value, bytes) else str(value)) or None


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / args["model_version"]
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
        self.max_input_tokens = int(params["max_input_tokens"])
        self.style, self.codes = core.language_style(self.tokenizer)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts = decode(pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy())
                language = optional_string(request, "TARGET_LANG")
                core.check_language(self.style, self.codes, language)
                ids = core.encode(self.tokenizer, texts, self.style, language, self.max_input_tokens)
                packed, lengths = core.pack(ids, self.tokenizer.pad_token_id or 0)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("INPUT_IDS", packed), pb_utils.Tensor("INPUT_LENGTHS", lengths)]))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
        return responses
