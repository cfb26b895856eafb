"""Triton Python model serving text in one hop: the texts of the whole dynamic batch are tokenized in one
fast-tokenizer call, run through ONNX Runtime in length groups (ort_batches.py), and, for classifiers, labelled,
all in one `execute`: no tensors cross between models, no second Python stub. The time of each stage (decode,
tokenize, infer, respond) is on the metrics port (stages.py)."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).parent))
from labels import label_and_score, label_names  # noqa: E402  (copied beside this file)
from ort_batches import MAX_PADDING, PaddedRunner, model_args, sessions  # noqa: E402
from sparse_terms import active_terms  # noqa: E402
from stages import StageClock  # noqa: E402
from text_input import Limits, Prompts, RequestBudget, TextEncoder, decode  # noqa: E402

STAGES = ("decode", "tokenize", "infer", "respond")


def refused(message):
    """A request's error response: INVALID_ARG (HTTP 400), the client's fault."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


def stack(rows):
    """One request's per-text outputs as one array, per-token ones zero-padded to the request's longest text."""
    if rows[0].ndim == 1:
        return np.stack(rows)
    width = max(r.shape[0] for r in rows)
    return np.stack([np.pad(r, [(0, width - r.shape[0])] + [(0, 0)] * (r.ndim - 1)) for r in rows])


class TritonPythonModel:
    def initialize(self, args):
        config, params, folder = model_args(args)
        self.max_length = int(params["max_length"])
        model, wide, self.neighbours = sessions(folder / "model.onnx", params, args)
        self.tokenizer = TextEncoder(folder, self.max_length, [i.name for i in model.get_inputs()])
        self.outputs = json.loads(params["model_outputs"])
        per_token = [o["name"] for o in config["output"] if o["name"] in self.outputs and len(o["dims"]) >= 2]
        self.runner = PaddedRunner(model, self.outputs, per_token, int(params.get("pad_token_id", "0")),
                                   float(params.get("max_padding", MAX_PADDING)), wide, self.neighbours,
                                   int(params.get("max_tokens", "0")))
        id2label = json.loads(params.get("id2label", "{}"))
        self.labels = label_names(id2label) if id2label else None
        self.activation = params.get("activation")  # a classifier's head (labels.py)
        self.sparse = params.get("sparse") == "true"  # a sparse encoder's active terms (sparse_terms.py)
        self.prompts = Prompts(params)
        self.limits = Limits.of(params)
        self.budget = RequestBudget(params)
        self.clock = StageClock(config["name"], STAGES)

    def finalize(self):
        self.clock.close()
        if self.neighbours is not None:
            self.neighbours.close()

    def respond(self, outputs, truncated, wanted):
        """The `wanted` outputs (those the request asked for: Triton sends no others) of one request's texts."""
        tensors = {name: stack([o[name][0] for o in outputs]) for name in self.outputs
                   if name in wanted or (self.labels is not None and name == "logits")}
        if self.labels is not None and wanted & {"label", "score"}:
            tensors["label"], tensors["score"] = label_and_score(tensors["logits"], self.labels, self.activation)
        if self.sparse and wanted & {"sparse_indices", "sparse_values"}:
            dense = stack([o["sentence_embedding"][0] for o in outputs])
            tensors["sparse_indices"], tensors["sparse_values"] = active_terms(dense)
        if "truncated" in wanted:
            tensors["truncated"] = np.array([[flag] for flag in truncated])
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(value))
                                                          for name, value in tensors.items() if name in wanted])

    def execute(self, requests):
        with self.runner.executing():
            return self.answer(requests)

    def answer(self, requests):
        self.clock.start()
        responses, texts, prompts, owners = [None] * len(requests), [], [], []
        for index, request in enumerate(requests):
            try:
                mine, prompt = self.prompts.apply(
                    decode(pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy(), limits=self.limits),
                    request.parameters())
            except ValueError as exc:
                responses[index] = refused(str(exc))
                continue
            owners.append((index, len(texts), len(mine), set(request.requested_output_names())))
            texts += mine
            prompts += [prompt] * len(mine)
        self.clock.lap("decode")
        if texts:
            parts, truncated = self.tokenizer.encode(texts, prompts)
            if any(truncated):
                pb_utils.Logger.log_warn(f"truncated {sum(truncated)} text(s) to {self.max_length} tokens")
            self.clock.lap("tokenize")
            tokens = {index: sum(p["input_ids"].shape[1] for p in parts[start:start + count])
                      for index, start, count, _ in owners}
            for index, count in tokens.items():
                problem = self.budget.refusal(count)
                if problem:
                    responses[index] = refused(problem)
            running = [owner for owner in owners if responses[owner[0]] is None]
            outputs = self.runner.run([p for _, start, count, _ in running for p in parts[start:start + count]]
                                      ) if running else []
            self.clock.lap("infer")
            done = 0
            for index, start, count, wanted in running:
                responses[index] = self.respond(outputs[done:done + count], truncated[start:start + count], wanted)
                done += count
            self.clock.lap("respond")
        self.clock.done()
        return responses
