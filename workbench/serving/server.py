"""Run a real tritonserver on 127.0.0.1 (or a given address): find it, start it on free ports, wait for readiness,
stop it by PID (its process group: the Python-backend stubs too)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from workbench.core.errors import ConfigError
from workbench.core.memory import first_to_go
from workbench.models.pins import pin
from workbench.serving.errors import PortInUseError, ServerStartError, ServerUnreachableError, TritonNotFoundError

HOST = "127.0.0.1"
API_PORT = 8080  # the API front's (serving/front.py) in `workbench serve` and the deployment image
STALL_S = 90.0  # a starting server with no log output and no CPU time for this long has stalled
MAX_READY_S = 1800  # however much progress it makes, a server not ready after this long has failed
ANY_ADDRESS = "0.0.0.0"  # every interface; clients on this machine still reach it on HOST


STUB = "triton_python_backend_stub"  # the process of one Python-backend model instance


@dataclass(frozen=True)
class TritonBinary:
    """A tritonserver executable and the backend folder it should use."""

    executable: Path
    backends: Path
    origin: str  # "PATH" or "nvidia-pytriton"
    python_stubs: Path | None = None


def find_tritonserver() -> TritonBinary:
    """`tritonserver` on PATH (NVIDIA's container), else the one bundled in the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonBinary(Path(on_path), Path("/opt/tritonserver/backends"), "PATH")
    try:
        import pytriton
    except ImportError:
        raise TritonNotFoundError(
            "no tritonserver on PATH and the nvidia-pytriton wheel (which bundles one) is not installed",
            f"pip install {pin('nvidia-pytriton')} (CPU, Python backend only), or run in NVIDIA's Triton container",
        ) from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    executable = root / "bin" / "tritonserver"
    if not executable.is_file():
        raise TritonNotFoundError(f"nvidia-pytriton is installed but {executable} is missing",
                                  f"reinstall it: pip install --force-reinstall {pin('nvidia-pytriton')}")
    return TritonBinary(executable, root / "backends", "nvidia-pytriton", root / "python_backend_stubs")


def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and all its descendants (0 once it is gone)."""
    total = 0
    try:
        root = psutil.Process(pid)
        for process in (root, *root.children(recursive=True)):
            total += process.memory_info().rss
    except psutil.NoSuchProcess:
        pass  # gone, or a child that exited between the listing and the reading
    return total


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ensure_port_free(port: int, what: str, host: str = HOST) -> None:
    """Refuse a port something listens on. A port whose last connection lingers in TIME_WAIT is free, as it is
    for tritonserver (which binds with SO_REUSEADDR): `serve` restarts on its fixed ports at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            raise PortInUseError(f"{what} port {port} on {host} is already in use",
                                 "stop whatever listens there, or choose another port (or none: a free one is "
                                 "picked)") from None


def watchdog(group: int, folders: Sequence[Path] = ()) -> subprocess.Popen[bytes]:
    """A watchdog (`workbench.serving.watchdog`) in a session of its own: it outlives this process to stop the
    process group `group` and remove `folders` when this process dies."""
    return subprocess.Popen([sys.executable, "-m", "workbench.serving.watchdog", str(os.getpid()), str(group),
                             *map(str, folders)], stdin=subprocess.DEVNULL, start_new_session=True)


def end_group(process: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM to `process`, up to `timeout` seconds for it to exit, then SIGKILL for its whole process group (what
    it left behind, or a process that ignored SIGTERM); its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return process.wait()


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def pick(cls, http: int | None = None, grpc: int | None = None, metrics: int | None = None,
             host: str = HOST) -> Ports:
        """The given ports (checked distinct and free on `host`) or free ones."""
        given = [port for port in (http, grpc, metrics) if port is not None]
        if len(set(given)) < len(given):
            raise ConfigError(f"the HTTP, gRPC and metrics ports must differ, got {http}, {grpc}, {metrics}",
                              "set distinct triton.http_port / grpc_port / metrics_port, or leave them unset")
        chosen = []
        for port, what in ((http, "HTTP"), (grpc, "gRPC"), (metrics, "metrics")):
            if port is None:
                port = free_port(host)
                while port in chosen:
                    port = free_port(host)
            else:
                ensure_port_free(port, what, host)
            chosen.append(port)
        return cls(*chosen)


class TritonServer:
    """A tritonserver process bound to `host` (127.0.0.1 unless told otherwise); use as a context manager so it is
    always stopped."""

    def __init__(self, repository: Path, workdir: Path, ports: Ports | None = None, binary: TritonBinary | None = None,
                 ready_timeout: float = STALL_S, host: str = HOST, cleanup: Sequence[Path] = ()) -> None:
        self.repository = Path(repository).resolve()
        self.workdir = Path(workdir).resolve()
        self.host = host
        self.ports = ports or Ports.pick(host=host)
        self.binary = binary or find_tritonserver()
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None  # also its process group: the Python-backend stubs are in it
        self.stopped_with: int | None = None  # the exit status once stop() has reaped it
        self.log_path = self.workdir / "tritonserver.log"
        self.timings: dict[str, float] = {}
        self.cleanup = tuple(Path(folder) for folder in cleanup)  # removed by the watchdog if this process dies
        self._watchdog: subprocess.Popen[bytes] | None = None

    @property
    def client_host(self) -> str:
        """The address clients on this machine use: the bound one, or loopback for every interface."""
        return HOST if self.host == ANY_ADDRESS else self.host

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"{self.client_host}:{self.ports.metrics}"

    def _backends(self) -> Path:
        """The wheel ships one Python-backend stub per Python version: assemble a backend folder using ours."""
        if self.binary.python_stubs is None:
            return self.binary.backends
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = self.binary.python_stubs / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise TritonNotFoundError(f"nvidia-pytriton has no Python-backend stub for Python {version}",
                                      "use Python 3.8-3.13, or NVIDIA's Triton container")
        folder = self.workdir / "backends" / "python"
        folder.mkdir(parents=True, exist_ok=True)
        for source in [*(self.binary.backends / "python").iterdir(), stub]:
            if source.is_file():
                link = folder / source.name
                link.unlink(missing_ok=True)
                link.symlink_to(source)
        return folder.parent

    def _environment(self) -> dict[str, str]:
        """Models run under the first python3 on PATH (this interpreter), linked against its own libpython."""
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def command(self) -> list[str]:
        return [str(self.binary.executable), f"--model-repository={self.repository}",
                f"--backend-directory={self._backends()}",
                f"--http-address={self.host}", f"--http-port={self.ports.http}",
                f"--grpc-address={self.host}", f"--grpc-port={self.ports.grpc}",
                f"--metrics-address={self.host}", f"--metrics-port={self.ports.metrics}",
                "--allow-metrics=true", "--exit-on-error=true", "--strict-readiness=true", "--log-verbose=0"]

    def start(self) -> TritonServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=self._environment(), start_new_session=True)
        first_to_go(self.process.pid)  # before it loads models and starts their stubs, which inherit it
        self.pid, self.stopped_with = self.process.pid, None
        self._watchdog = watchdog(self.pid, self.cleanup)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.timings["ready_seconds"] = round(time.perf_counter() - start, 3)
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait_ready(self) -> None:
        """Until the server is ready: however long it takes while it makes progress (its log grows, or its processes
        use CPU time: a busy host loads models slowly), a failure when it exits, stalls for `ready_timeout` seconds,
        or is still not ready after MAX_READY_S."""
        start = last_change = time.monotonic()
        mark = self._progress()
        while True:
            if self.process is not None and self.process.poll() is not None:
                taken = self._ports_taken()
                if taken:
                    raise PortInUseError(
                        f"tritonserver could not bind {taken}: another process took it after it was found free (two "
                        f"servers started at once?); this server exited", "stop the other server first, or choose "
                        "other --http-port / --grpc-port / --metrics-port values (0 picks a free one)")
                raise ServerStartError(f"tritonserver exited with code {self.process.returncode} while starting:\n"
                                       f"{self.log_tail()}", "read the log above (model config or backend errors)")
            if self._listening() and self.is_ready():  # this server's answer, not another's on the same port
                return
            now, seen = time.monotonic(), self._progress()
            if seen != mark:
                mark, last_change = seen, now
            elif now - last_change > self.ready_timeout:
                raise ServerStartError(f"tritonserver stalled while starting: no log output and no CPU time for "
                                       f"{self.ready_timeout:.0f} s, not ready:\n{self.log_tail()}",
                                       "read the log above; a model that loads slowly without output may need a "
                                       "longer ready_timeout")
            if now - start > MAX_READY_S:
                raise ServerStartError(f"tritonserver was not ready after {MAX_READY_S} s:\n{self.log_tail()}",
                                       "read the log above (a model that never finishes loading)")
            time.sleep(0.2)

    def _listening(self) -> bool:
        """This server's own process listens on its HTTP port (a ready answer there is then its own)."""
        try:
            held = psutil.Process(self.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.ports.http for c in held)

    def _ports_taken(self) -> str:
        """This server's ports another process listens on ("" when none): the cause of a failed bind."""
        taken = {c.laddr.port for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        return ", ".join(f"{what} port {port}" for what, port in
                         (("HTTP", self.ports.http), ("gRPC", self.ports.grpc), ("metrics", self.ports.metrics))
                         if port in taken)

    def _progress(self) -> tuple[int, float]:
        """The log's size and the CPU seconds (to 0.1 s) of the server and its model processes."""
        try:
            size = self.log_path.stat().st_size
        except OSError:
            size = 0
        cpu = 0.0
        try:
            server = psutil.Process(self.pid)
            for process in (server, *server.children(recursive=True)):
                times = process.cpu_times()
                cpu += times.user + times.system
        except psutil.Error:
            pass
        return size, round(cpu, 1)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def returncode(self) -> int | None:
        """The server's exit status (negative: killed by that signal, e.g. -9), None while it runs."""
        return self.process.poll() if self.process is not None else self.stopped_with

    def group(self) -> list[psutil.Process]:
        """Live processes of the server's process group: the server and its Python-backend stubs, which outlive a
        server killed with SIGKILL (orphans keep the group)."""
        if self.pid is None:
            return []
        members = []
        for process in psutil.process_iter(["status"]):
            try:
                if os.getpgid(process.pid) == self.pid and process.info["status"] != psutil.STATUS_ZOMBIE:
                    members.append(process)
            except ProcessLookupError:
                pass
        return members

    def rss_bytes(self) -> int:
        """Resident memory of the server process and its children (the Python-backend stubs), in bytes."""
        return tree_rss(self.process.pid) if self.process is not None else 0

    def instance_memory(self) -> dict[str, int]:
        """Each Python-backend model instance (`<model>_<group>_<index>`, its stub's argument) and its proportional
        set size in bytes: its own memory and its share of what it maps with the others (shared libraries)."""
        held: dict[str, int] = {}
        if self.process is None:
            return held
        try:
            stubs = [p for p in psutil.Process(self.process.pid).children() if p.name().startswith(STUB)]
            for stub in stubs:
                held[stub.cmdline()[-2]] = stub.memory_full_info().pss
        except psutil.Error:
            pass  # the server or a stub went away while it was read
        return held

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Calls made inside: a ServerUnreachableError from this server after it died says how (its exit status)."""
        try:
            yield
        except ServerUnreachableError as error:
            code = self._exit_status(grace=5.0)
            if code is None:
                raise
            raise ServerUnreachableError(f"{error.problem}; tritonserver (pid {self.pid}) {_ended(code)}",
                                         f"read {self.log_path} for why it stopped, then start it again") from None

    def _exit_status(self, grace: float) -> int | None:
        """The exit status, waiting up to `grace` seconds for a server whose sockets closed as it died."""
        if self.process is None:
            return self.stopped_with
        try:
            return self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL for the whole process group (the model stubs too, also those a killed server left
        behind) once the server is gone or did not exit in time; returns when none of the group is left. Returns the
        server's exit status (also `returncode` afterwards)."""
        if self.process is None:
            return self.stopped_with
        start = time.perf_counter()
        self.stopped_with = end_group(self.process, timeout)
        deadline = time.monotonic() + timeout
        while self.group() and time.monotonic() < deadline:  # SIGKILLed stubs take a moment to go
            time.sleep(0.05)
        self.timings["stop_seconds"] = round(time.perf_counter() - start, 3)
        self.process = None
        if self._watchdog is not None:  # the group is gone: its watchdog has nothing left to do
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        self._drop_instance_locks()
        return self.stopped_with

    def _drop_instance_locks(self) -> None:
        """The lock folders of the repository's Python model instances (`ort_batches.Neighbours`), which an instance
        killed before it finalized leaves under the temporary folder; none of the group is left to hold them."""
        from workbench.serving.backend.ort_batches import instances_folder

        for version in self.repository.glob("*/[0-9]*"):
            shutil.rmtree(instances_folder(version), ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ended(code: int) -> str:
    """'exited with status 1', 'was killed by SIGKILL (exit status -9)'."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name} (exit status {code})"
