"""`workbench serve`: a run's (or any) model repository on a real tritonserver until Ctrl-C, SIGTERM or SIGHUP."""
from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from workbench.core.advice import run_again
from workbench.core.data import load_corpus
from workbench.core.errors import ConfigError, MissingArtifactError
from workbench.core.record import RunRecord, StepStatus
from workbench.interrupt import SIGNALS
from workbench.measure.load import write_input_data
from workbench.measure.perf_analyzer import PerfAnalyzer, find_perf_analyzer, stability_options
from workbench.serving.backend.api_schema import parse_keys
from workbench.serving.client import text_array
from workbench.serving.endpoints import (
    SAMPLE_TEXT,
    TextEndpoint,
    curl_command,
    perf_analyzer_command,
    text_endpoints,
)
from workbench.serving.errors import PortInUseError, RepositoryError, ServerStartError
from workbench.serving.front import ApiFront, check_api_port, front_spec
from workbench.serving.front import usage_lines as front_lines
from workbench.serving.repository import MARKER, changed_files, ours_and_untouched, published_by, written_files
from workbench.serving.server import ANY_ADDRESS, HOST, Ports, TritonServer

LOAD_TEXTS = 64  # corpus texts perf_analyzer cycles through, one per request
WATCH_S = 0.5  # how often serve looks at its processes
WINDOW_REQUESTS = 200  # perf_analyzer's measurement windows hold at least this many requests


class Stopped(BaseException):
    """A stop signal arrived (raised in the main thread, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_repository(run_dir: Path) -> Path:
    """The repository the run's triton step deployed: the published one while it holds what the run checked (the
    same marker as the run's own copy or, where that copy is gone, a marker naming this run), else the run's own
    copy (`<run>/model_repository/<name>`)."""
    record = RunRecord.load(run_dir)
    triton = record.step_entry("triton")
    if triton.status != StepStatus.OK:
        why = f"{triton.label}: {triton.detail}" if triton.detail else triton.label
        raise MissingArtifactError(f"the run in {run_dir} has no deployment to serve (its triton step: {why})",
                                   f"deploy it first: {run_again(['triton'], run_dir, lab=False)}")
    published = Path(triton.metrics["repository"])
    intact = bool(triton.metrics.get("published")) and ours_and_untouched(published)
    again = f"deploy it again: {run_again(['triton'], run_dir, lab=False)}"
    try:
        run_copy = record.artifact("triton.repository")
    except MissingArtifactError:
        if intact and published_by(published) == str(run_dir.resolve()):
            return published
        raise MissingArtifactError(f"the run's copy of its repository is gone and {published} no longer holds what "
                                   "the run checked", again) from None
    if intact and written_files(published) == written_files(run_copy):  # the files the run checked, untouched
        return published
    changed = changed_files(run_copy)
    if changed:
        raise RepositoryError(f"{run_copy} no longer holds what the run checked: {', '.join(changed[:5])}"
                              f"{' ...' if len(changed) > 5 else ''} changed since the triton step wrote it (and "
                              f"{published} holds other files)", again)
    if triton.metrics.get("published"):
        print(f"note: {published} no longer holds what this run checked (changed, or published by another run): "
              f"serving the run's own copy, {run_copy}", file=sys.stderr)
    return run_copy


def checked_repository(repository: Path, unverified: bool) -> Path:
    """`repository` to serve (`--repository`): refused by name where the workbench wrote it and a file changed since
    (as `--run` refuses it), unless `unverified`; a note where the workbench did not write it."""
    if written_files(repository) is None:
        if repository.is_dir():
            print(f"note: {repository} was not written by the workbench (no {MARKER}): it is served unchecked",
                  file=sys.stderr, flush=True)
        return repository
    changed = changed_files(repository)
    if changed and not unverified:
        raise RepositoryError(f"{repository} no longer holds what its triton step checked: {', '.join(changed[:5])}"
                              f"{' ...' if len(changed) > 5 else ''} changed since it was written",
                              "deploy it again (workbench run --resume --output-dir <run> --steps triton), or serve "
                              "the changed files as they are with --unverified")
    if changed:
        print(f"warning: serving {repository} unverified: {', '.join(changed[:5])} changed since its triton step "
              "checked it", file=sys.stderr, flush=True)
    return repository


def api_keys(value: str, source: str) -> str | None:
    """The API front's keys in `value` (comma-separated, each stripped), as the front reads them; ConfigError
    naming an empty entry of `source`."""
    try:
        keys = parse_keys(value, source)
    except ValueError as exc:
        raise ConfigError(str(exc).partition(": ")[0], "give each key between commas, e.g. \"alpha,beta\", or none "
                                                       "at all") from None
    return ",".join(keys) or None


def check_host(host: str) -> None:
    """`host` must be an IPv4 address of this machine (or 0.0.0.0)."""
    try:
        ipaddress.IPv4Address(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--host {host} is not an IPv4 address of this machine ({exc})",
                          f"leave it out ({HOST}: this machine only), or give 0.0.0.0 or one of its addresses"
                          ) from None


def exposure_warning(host: str, open_front: bool = False) -> str | None:
    """The warning for a server other machines can reach (None on loopback); `open_front`: with an API front that
    asks for no key."""
    if ipaddress.IPv4Address(host).is_loopback:
        return None
    where = "every network interface" if host == ANY_ADDRESS else f"address {host}"
    front = " The API front asks for no key either: set WORKBENCH_API_KEY (or --api-key)." if open_front else ""
    return (f"WARNING: tritonserver listens on {where}: whoever can reach this machine can send it requests and read "
            "its models' configurations and statistics, with no authentication. Leave out --host to serve on "
            f"{HOST} only.{front}")


def pick_ports(http: int, grpc: int, metrics: int, host: str) -> Ports:
    """The given ports (0: a free one), checked distinct and free on `host`."""
    try:
        return Ports.pick(*(port or None for port in (http, grpc, metrics)), host=host)
    except (PortInUseError, ConfigError) as exc:
        raise type(exc)(exc.problem, "stop whatever listens there, or choose other --http-port / --grpc-port / "
                                     "--metrics-port values (0 picks a free one)") from None


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise Stopped in the main thread; later ones are ignored while it stops."""
    def handle(signum: int, frame: Any) -> None:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def usage_lines(server: TritonServer, endpoints: list[TextEndpoint], tool: PerfAnalyzer | None,
                input_data: Path, front: ApiFront | None = None) -> list[str]:
    """What `serve` prints once the server is ready: URLs, then a curl and a perf_analyzer command per text model,
    and the API front's requests."""
    pid = server.process.pid if server.process else None
    lines = [f"tritonserver (pid {pid}) serves {server.repository}",
             f"  HTTP:    http://{server.http_url}", f"  gRPC:    {server.grpc_url}",
             f"  metrics: http://{server.metrics_url}/metrics", f"  log:     {server.log_path}"]
    if front is not None:
        lines += front_lines(front, SAMPLE_TEXT)
    executable = tool.shell_command() if tool else ["perf_analyzer"]
    install = "" if tool else " (install it first: workbench install-perf-analyzer)"
    options = stability_options(WINDOW_REQUESTS)
    for endpoint in endpoints:
        if endpoint.reranks:
            lines += [f"a query and two documents through {endpoint.model} (its answer: {endpoint.output}; "
                      "TOP_K asks for the best):", f"  {curl_command(server.http_url, endpoint, SAMPLE_TEXT)}"]
            continue
        lines += [f"one text through {endpoint.model} (its answer: {endpoint.output}):",
                  f"  {curl_command(server.http_url, endpoint, SAMPLE_TEXT)}",
                  f"latency and throughput at concurrency 1, one corpus text per request, with perf_analyzer{install}:",
                  f"  {perf_analyzer_command(executable, server.grpc_url, endpoint, input_data, options)}"]
    return [*lines, "Ctrl-C, SIGTERM or SIGHUP stops the server."]


def front_for(repository: Path, api_port: int | None) -> bool:
    """Whether `serve` starts the API front: asked for (`api_port` not None) and the repository has a model it
    answers for; a note on stderr where it has none."""
    if api_port is None:
        return False
    try:
        front_spec(repository)
    except RepositoryError as exc:
        print(f"note: no API front: {exc.problem}", file=sys.stderr, flush=True)
        return False
    return True


def watch(server: TritonServer, front: ApiFront | None) -> None:
    """Until tritonserver or the front exits by itself (each reaped): then ServerStartError naming it."""
    while True:
        if front is not None:
            front.check_running("while serving")
        code = server.process.poll() if server.process else 0
        if code is not None:
            raise ServerStartError(f"tritonserver exited by itself with code {code}:\n{server.log_tail()}",
                                   "read its log above; fix the repository or free the resources it names")
        time.sleep(WATCH_S)


def serve(repository: Path, host: str, ports: tuple[int, int, int], api_port: int | None = None,
          api_key: str | None = None, front_workers: int = 1) -> int:
    """Serve `repository` (and the API front on `api_port`, 0: a free one; None: none) until a stop signal; 128 +
    the signal's number once the server is stopped (as an interrupted `workbench run`). A server that exits by
    itself is a ServerStartError with its log."""
    endpoints = text_endpoints(repository)
    check_host(host)
    chosen = pick_ports(*ports, host=host)
    with_front = front_for(repository, api_port)
    if with_front and api_port:
        if api_port in (chosen.http, chosen.grpc, chosen.metrics):
            raise ConfigError(f"--api-port {api_port} is one of tritonserver's ports",
                              "choose another --api-port (0 picks a free one)")
        check_api_port(api_port, host)  # free now, as the others
    warning = exposure_warning(host, with_front and not api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    with stop_on_signals():
        try:
            with tempfile.TemporaryDirectory(prefix="workbench-serve-") as workdir:
                input_data = write_input_data(Path(workdir) / "texts.json",
                                              [{"TEXT": text_array([t])} for t in load_corpus()[:LOAD_TEXTS]])
                server = TritonServer(repository, Path(workdir), chosen, host=host, cleanup=(Path(workdir),))
                with server, ApiFront(repository, server.grpc_url, Path(workdir) / "front", host, api_port or 0,
                                      api_key, front_workers) if with_front else nullcontext() as front:
                    print("\n".join(usage_lines(server, endpoints, find_perf_analyzer(), input_data, front)),
                          flush=True)
                    watch(server, front)
        except Stopped as stopped:
            print(f"stopped ({stopped}): tritonserver and its model processes are gone", file=sys.stderr, flush=True)
            return 128 + stopped.signum
