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
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from workbench.core.atomic import write_text
from workbench.core.errors import RepositoryError, ServerStartError
from workbench.serving.backend.api_front import KEY_VARIABLE, FrontSpec, ServedModel
from workbench.serving.endpoints import request_lines, text_endpoints
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
    vector per text), sparse encoders (their active terms too) and one-score rerankers, with their limits, prompts
    and tokenizer folder; RepositoryError when there is none."""
    models = read_repository(repository)
    served = []
    for endpoint in text_endpoints(repository):
        config = models[endpoint.model]
        names = [step.model_name for step in config.ensemble_scheduling.step] + [endpoint.model]
        tokenizing = next((n for n in names if "max_length" in models[n].parameters), None)
        output = next(o for o in config.output if o.name == endpoint.output) if not endpoint.reranks else None
        embeds = output is not None and len(output.dims) == 1 and output.data_type == 11  # TYPE_FP32
        scores = endpoint.reranks and next(o for o in config.output if o.name == "scores").dims[-1] == 1
        if tokenizing is None or not (embeds or scores):
            continue
        sparse = any(o.name == "sparse_indices" for o in config.output)
        params = _parameters(names, models)
        versions = sorted((p for p in (repository / tokenizing).iterdir() if p.name.isdigit()), key=lambda p: int(
            p.name))

        def number(key: str) -> int | None:
            return int(params[key]) or None if key in params else None
        served.append(ServedModel(
            id=endpoint.model, kind="rerank" if endpoint.reranks else "sparse" if sparse else "embeddings",
            output=endpoint.output,
            dimensions=output.dims[0] if embeds else 0, tokenizer=str(versions[-1].relative_to(repository)),
            max_length=int(params["max_length"]), batch=config.max_batch_size, max_texts=number("max_texts"),
            max_text_chars=number("max_text_chars"), max_documents=number("max_documents"),
            max_request_tokens=number("max_request_tokens"), prompts=json.loads(params.get("prompts", "{}")),
            default_prompt_name=params.get("default_prompt_name", "")))
    if not served:
        raise RepositoryError(f"{repository} holds no embedding model or one-score reranker for the API front",
                              "serve it without the front (--api-port 0): Triton's own protocol answers it")
    return FrontSpec(models=served)


class ApiFront:
    """The front for `repository` served by the Triton at `triton_grpc`, on `host`:`port` (0: a free one), in a
    process group of its own with a watchdog that stops it when this process dies; `api_key` asked of clients."""

    def __init__(self, repository: Path, triton_grpc: str, workdir: Path, host: str = HOST, port: int = 0,
                 api_key: str | None = None) -> None:
        self.repository, self.triton_grpc, self.workdir = repository, triton_grpc, workdir
        self.host, self.api_key = host, api_key
        if port:
            ensure_port_free(port, "API front", host)
        self.port = port or free_port(host)
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
                str(self.repository), "--triton", self.triton_grpc, "--host", self.host, "--port", str(self.port)]

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
        """/health answered (ready or not: the front itself is up)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except (urllib.error.URLError, OSError):
            return False

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while not self._answers():
            if self.process is not None and self.process.poll() is not None:
                raise ServerStartError(f"the API front exited with code {self.process.returncode} while starting:\n"
                                       f"{self.log_tail()}", "read its log above")
            if time.monotonic() > deadline:
                raise ServerStartError(f"the API front did not answer on {self.url} within {READY_S:.0f} s:\n"
                                       f"{self.log_tail()}", "read its log above")
            time.sleep(0.1)

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
