"""Triton Python model serving a cross-encoder: one request is a query (or one query per document) and its
documents, tokenized as pairs in one call, run through ONNX Runtime in length groups (ort_batches.py); it answers
the scores in the documents' order and, when the request asks TOP_K, the best documents' indices and scores.
Requests are not batched together (max_batch_size 0): a request's documents are its batch."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).parent))
from ort_batches import MAX_PADDING, PaddedRunner, model_args, sessions  # noqa: E402  (copied)
from stages import StageClock  # noqa: E402
from text_input import Limits, RequestBudget, TextEncoder, decode  # noqa: E402

STAGES = ("decode", "tokenize", "infer", "respond")


def optional_input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        config, params, folder = model_args(args)
        self.max_length = int(params["max_length"])
        chars = Limits.of(params).chars  # a query's count is the documents' (one, or one per document)
        self.documents = Limits(int(params["max_documents"]), chars, "triton.max_documents")
        self.queries = Limits(None, chars)
        model, wide, self.neighbours = sessions(folder / "model.onnx", params, args)
        self.tokenizer = TextEncoder(folder, self.max_length, [i.name for i in model.get_inputs()])
        self.outputs = json.loads(params["model_outputs"])
        self.runner = PaddedRunner(model, self.outputs, [], int(params.get("pad_token_id", "0")),
                                   float(params.get("max_padding", MAX_PADDING)), wide, self.neighbours,
                                   int(params.get("max_tokens", "0")))
        self.budget = RequestBudget(params)
        self.clock = StageClock(config["name"], STAGES)

    def finalize(self):
        self.clock.close()
        if self.neighbours is not None:
            self.neighbours.close()

    def read(self, request):
        """The request's (query, document) pairs and TOP_K (None when not asked); ValueError naming what is wrong."""
        documents = decode(pb_utils.get_input_tensor_by_name(request, "DOCUMENTS").as_numpy(), "DOCUMENTS",
                           self.documents)
        if not documents:
            raise ValueError("DOCUMENTS is empty: send at least one document to score against the query")
        queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
        if queries.size not in (1, len(documents)):
            raise ValueError(f"{queries.size} queries for {len(documents)} documents: send one query for all of "
                             "them, or one per document")
        queries = decode(queries, "QUERY", self.queries)
        top_k = optional_input(request, "TOP_K")
        if top_k is not None:
            top_k = int(top_k.reshape(-1)[0])
            if not 1 <= top_k <= len(documents):
                raise ValueError(f"TOP_K {top_k} is not between 1 and the {len(documents)} documents sent")
        return list(zip(queries * len(documents) if len(queries) == 1 else queries, documents)), top_k

    def respond(self, outputs, truncated, top_k, wanted):
        """The `wanted` outputs of one request's pairs; the TOP_K best by score (one score per pair)."""
        tensors = {name: np.concatenate([o[name] for o in outputs]) for name in self.outputs if name in wanted}
        if top_k is not None and wanted & {"top_indices", "top_scores"}:
            scores = np.concatenate([o["scores"] for o in outputs])
            if scores.shape[1] != 1:
                raise ValueError(f"TOP_K ranks one score per document; this model scores {scores.shape[1]} labels")
            order = np.argsort(-scores[:, 0], kind="stable")[:top_k]
            tensors["top_indices"], tensors["top_scores"] = order.astype(np.int64), scores[order, 0]
        if "truncated" in wanted:
            tensors["truncated"] = np.array(truncated, dtype=bool)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(value))
                                                          for name, value in tensors.items() if name in wanted])

    def execute(self, requests):
        with self.runner.executing():
            return [self.answer(request) for request in requests]

    def answer(self, request):
        self.clock.start()
        try:
            pairs, top_k = self.read(request)
            self.clock.lap("decode")
            parts, truncated = self.tokenizer.encode(pairs)
            self.clock.lap("tokenize")
            tokens = sum(part["input_ids"].shape[1] for part in parts)
            problem = self.budget.refusal(tokens)
            if problem:
                raise ValueError(problem)
            outputs = self.runner.run(parts)
            self.clock.lap("infer")
            response = self.respond(outputs, truncated, top_k, set(request.requested_output_names()))
            self.clock.lap("respond")
        except ValueError as exc:
            response = pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))

        self.clock.done()
        return response
