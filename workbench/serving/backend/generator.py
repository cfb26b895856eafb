"""Triton Python model: greedy generation with transformers or CTranslate2 (`engine` parameter) on token ids.

Requests of different lengths are batched together (ragged): sources are padded and masked (right for seq2seq,
left for decoder-only) by generation_core, generated once with the largest max_new_tokens asked, and each answer is
cut to its own max_new_tokens (greedy decoding makes that the same as generating it alone).
"""
import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).parent))
import generation_core as core  # noqa: E402  (copied beside this file)
from gen_tokenize import optional_string  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / args["model_version"]
        self.kind, self.engine_name = params["kind"], params["engine"]
        self.default_new, self.limit = int(params["max_new_tokens"]), int(params["max_new_tokens_limit"])
        threads = int(params.get("threads", "0")) or None
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
        if self.kind == "decoder":
            self.tokenizer.padding_side = "left"
        self.style, self.codes = core.language_style(self.tokenizer)
        if self.engine_name == "hf":
            import torch
            import transformers

            if threads:
                torch.set_num_threads(threads)
            auto = transformers.AutoModelForSeq2SeqLM if self.kind == "seq2seq" else transformers.AutoModelForCausalLM
            self.model = auto.from_pretrained(str(folder / "hf")).eval()
        else:
            import ctranslate2

            engine = ctranslate2.Translator if self.kind == "seq2seq" else ctranslate2.Generator
            self.model = engine(str(folder / "ct2"), device="cpu", compute_type=params["compute_type"],
                                intra_threads=threads or 0)

    def generate(self, sequences, max_new_tokens, language):
        run = core.hf_generate if self.engine_name == "hf" else core.ct2_generate
        return run(self.model, self.tokenizer, self.kind, sequences, max_new_tokens, self.style, language)

    def execute(self, requests):
        responses = [None] * len(requests)
        by_language = {}
        for index, request in enumerate(requests):
            try:
                ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy()
                lengths = pb_utils.get_input_tensor_by_name(request, "INPUT_LENGTHS").as_numpy()
                limit_tensor = pb_utils.get_input_tensor_by_name(request, "MAX_NEW_TOKENS")
                max_new = int(limit_tensor.as_numpy().reshape(-1)[0]) if limit_tensor is not None else self.default_new
                core.check_max_new_tokens(max_new, self.limit)
                language = optional_string(request, "TARGET_LANG")
                core.check_language(self.style, self.codes, language)
                by_language.setdefault(language, []).append((index, core.unpack(ids, lengths), max_new))
            except ValueError as exc:
                responses[index] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
        for language, items in by_language.items():
            sequences = [seq for _, seqs, _ in items for seq in seqs]
            outputs = self.generate(sequences, max(m for _, _, m in items), language)
            start = 0
            for index, seqs, max_new in items:
                mine = [out[:max_new] for out in outputs[start:start + len(seqs)]]
                start += len(seqs)
                packed, lengths = core.pack(mine, self.tokenizer.pad_token_id or 0)
                responses[index] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("OUTPUT_IDS", packed), pb_utils.Tensor("OUTPUT_LENGTHS", lengths)])
        return responses
