"""The API front beside a served repository (`backend/api_front.py`): what it serves, read from the repository
(`front_spec`), and the front as a process of its own, started beside a running Triton, waited for and stopped by
PID (`ApiFront`), with the commands that call it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from workbench.core.atomic import write_text
from workbench.serving.backend.api_schema import KEY_VARIABLE, FrontSpec, ServedModel
from workbench.serving.endpoints import request_lines, text_endpoints
from workbench.serving.errors import PortInUseError, RepositoryError, ServerStartError
from workbench.serving.repository import read_repository
from workbench.serving.server import HOST, end_group, ensure_port_free, free_port, watchdog

READY_S = 60.0  # a front not answering /health (200 or 503) by then failed to start


def _parameters(names: list[str], models: dict[str, mc.ModelConfig]) -> dict[str, str]:
    """The string parameters of `names`' configs, later ones winning."""
    merged: dict[str, str] = {}
    for name in names:
        merged.update({key: value.string_value for key, value in models[name].parameters.items()})
    return merged


def front_spec(repository: Path) -> FrontSpec:
    """The models of `repository` the front answers for: embedding models (an endpoint whose answer is one float
    vector per text), sparse encoders (their active terms too), one-score rerankers and text classifiers (one label
    set per text), with their limits, prompts and tokenizer folder; RepositoryError when there is none."""
    models = read_repository(repository)
    served = []
    for endpoint in text_endpoints(repository):
        config = models[endpoint.model]
        names = [step.model_name for step in config.ensemble_scheduling.step] + [endpoint.model]
        tokenizing = next((n for n in names if "max_length" in models[n].parameters), None)
        outputs = {o.name: o for o in config.output}
        params = _parameters(names, models)
        answer = outputs.get(endpoint.output) if not endpoint.reranks else None
        embeds = answer is not None and len(answer.dims) == 1 and answer.data_type == 11  # TYPE_FP32
        scores = endpoint.reranks and outputs["scores"].dims[-1] == 1
        classifies = "logits" in outputs and len(outputs["logits"].dims) == 1 and "id2label" in params
        if tokenizing is None or not (embeds or scores or classifies):
            continue
        kind = ("rerank" if endpoint.reranks else "sparse" if "sparse_indices" in outputs else
                "classify" if classifies else "embeddings")
        versions = sorted((p for p in (repository / tokenizing).iterdir() if p.name.isdigit()), key=lambda p: int(
            p.name))

        def number(key: str) -> int | None:
            return int(params[key]) or None if key in params else None
        labels = json.loads(params["id2label"]) if classifies else {}
        served.append(ServedModel(
            id=endpoint.model, kind=kind, output="logits" if kind == "classify" else endpoint.output,
            dimensions=answer.dims[0] if embeds and answer is not None else 0,
            tokenizer=str(versions[-1].relative_to(repository)), max_length=int(params["max_length"]),
            batch=config.max_batch_size, max_texts=number("max_texts"), max_text_chars=number("max_text_chars"),
            max_documents=number("max_documents"), max_request_tokens=number("max_request_tokens"),
            prompts=json.loads(params.get("prompts", "{}")), default_prompt_name=params.get("default_prompt_name", ""),
            labels=[labels[str(i)] for i in range(len(labels))], activation=params.get("activation", "")))
    if not served:
        raise RepositoryError(f"{repository} holds no embedding model, reranker or text classifier for the API front",
                              "serve it without the front (--no-api): Triton's own protocol answers it")
    return FrontSpec(models=served)


def check_api_port(port: int, host: str) -> None:
    """PortInUseError naming --api-port where `port` is taken on `host`."""
    try:
        ensure_port_free(port, "API front", host)
    except PortInUseError as exc:
        raise PortInUseError(exc.problem, "stop whatever listens there (another serve?), or choose another "
                                          "--api-port (0 picks a free one)") from None


class ApiFront:
    """The front for `repository` served by the Triton at `triton_grpc`, on `host`:`port` (0: a free one), in
    `workers` processes, in a process group of its own with a watchdog that stops it when this process dies;
    `api_key` (comma-separated keys) asked of clients."""

    def __init__(self, repository: Path, triton_grpc: str, workdir: Path, host: str = HOST, port: int = 0,
                 api_key: str | None = None, workers: int = 1) -> None:
        self.repository, self.triton_grpc, self.workdir = repository, triton_grpc, workdir
        self.host, self.api_key, self.workers = host, api_key, workers
        if port:
            check_api_port(port, host)
        self.port = port or free_port(host)
        self.instance = uuid.uuid4().hex
        self.spec = front_spec(repository)
        self.process: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST if self.host == '0.0.0.0' else self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "api_front.log"

    def command(self, spec: Path) -> list[str]:
        return [sys.executable, "-m", "workbench.serving.backend.api_front", "--spec", str(spec), "--repository",
                str(self.repository), "--triton", self.triton_grpc, "--host", self.host, "--port", str(self.port),
                "--workers", str(self.workers), "--instance", self.instance]

    def start(self) -> ApiFront:
        self.workdir.mkdir(parents=True, exist_ok=True)
        spec = write_text(self.workdir / "front.json", self.spec.model_dump_json(indent=2))
        env = {**os.environ, KEY_VARIABLE: self.api_key or ""}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(spec), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self.watchdog = watchdog(self.process.pid)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        """This front answered /health (ready or not: the front itself is up), not another on the same port."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                answer = response.read()
        except urllib.error.HTTPError as error:
            answer = error.read()
        except (urllib.error.URLError, OSError):
            return False
        try:
            return bool(json.loads(answer).get("instance") == self.instance)
        except (ValueError, AttributeError):
            return False

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while not self._answers():
            self.check_running("while starting")
            if time.monotonic() > deadline:
                raise ServerStartError(f"the API front did not answer on {self.url} within {READY_S:.0f} s:\n"
                                       f"{self.log_tail()}", "read its log above")
            time.sleep(0.1)

    def check_running(self, when: str) -> None:
        """ServerStartError naming the front, its exit code and its log, once it has exited (reaped)."""
        if self.process is not None and self.process.poll() is not None:
            raise ServerStartError(f"the API front (pid {self.process.pid}, port {self.port}) exited with code "
                                   f"{self.process.returncode} {when}:\n{self.log_tail()}",
                                   "read its log above (a port taken: choose another --api-port); serve again, or "
                                   "with --no-api to serve Triton alone")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL for its process group; then its watchdog goes."""
        if self.process is not None:
            end_group(self.process, timeout)
            self.process = None
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
            self.watchdog = None

    def __enter__(self) -> ApiFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def usage_lines(front: ApiFront, sample: str) -> list[str]:
    """What `serve` prints for the front: its URL and PID, then its requests (`request_lines`)."""
    pid, names = front.process.pid if front.process else None, ", ".join(m.id for m in front.spec.models)
    return [f"  OpenAI-compatible API: {front.url}/v1 (pid {pid}; models: {names})",
            *request_lines(front.url, [(m.id, m.kind) for m in front.spec.models], sample, bool(front.api_key))]
