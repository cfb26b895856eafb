"""NVIDIA's perf_analyzer: find it (PATH, or the copy in this environment) and install it from a tritonclient wheel,
with a `perf_analyzer` wrapper on this environment's PATH; the stability settings every workbench call uses.
Running a measurement with it is load generation: `workbench.measure.load.perf_analyzer_level`."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workbench.core.atomic import atomic_path, write_text
from workbench.core.errors import DependencyMissingError
from workbench.models.pins import pin

# A deliberate pin of its own, not the project's tritonclient: the newest wheel whose perf_analyzer runs on glibc 2.36
# (Debian 12). Only its binary is taken; the Python package stays the one pyproject.toml pins.
PERF_ANALYZER_WHEEL = "tritonclient==2.48.0"
TOOLS = Path(sys.prefix) / "tools" / "perf_analyzer"
WRAPPER = Path(sys.prefix) / "bin" / "perf_analyzer"  # on PATH while this environment is active

# perf_analyzer's defaults never settle on a busy 2-core host: it reports only once its last 3 windows (5 s each) agree
# within 10% on both throughput and mean latency, and gives up after 10 windows; at concurrency 1 beside a test run
# (load 9 on 2 cores) windows differ by 20-60%, and the 4 windows at 30% the workbench allowed failed 3 times in 4.
# Every workbench call, and the command `workbench serve` prints, allows 50% between windows of at least `requests`
# requests each (count_windows: a window lasts until it holds them, 1 s at least) and up to 20 windows, the first of
# which are warm-up: there, that converged 26 times in 26, in 3-16 s. perf_analyzer merges the 3 agreeing windows
# into what it reports.
STABILITY_TRIALS = 20


def stability_options(requests: int) -> list[str]:
    """perf_analyzer options that find a stable measurement on a noisy host: windows of at least `requests`."""
    return ["--stability-percentage=50", f"--max-trials={STABILITY_TRIALS}", "--measurement-mode=count_windows",
            f"--measurement-request-count={requests}"]


@dataclass(frozen=True)
class PerfAnalyzer:
    executable: Path
    libraries: Path | None = None

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.libraries:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.libraries), env.get("LD_LIBRARY_PATH"))
                                                     if p)
        return env

    def shell_command(self) -> list[str]:
        """What runs it when typed into a shell: itself, or with the library path it needs."""
        if self.libraries is None:
            return [str(self.executable)]
        return ["env", f"LD_LIBRARY_PATH={self.libraries}", str(self.executable)]


def find_perf_analyzer() -> PerfAnalyzer | None:
    """perf_analyzer on PATH (NVIDIA's SDK container), this environment's wrapper, or the copy
    `workbench install-perf-analyzer` made (with the libraries it needs)."""
    on_path = shutil.which("perf_analyzer") or (WRAPPER if WRAPPER.is_file() else None)
    if on_path:
        return PerfAnalyzer(Path(on_path))
    local = TOOLS / "perf_analyzer"
    return PerfAnalyzer(local, TOOLS / "lib") if local.is_file() else None


def install_perf_analyzer() -> PerfAnalyzer:
    """Take perf_analyzer from a tritonclient wheel (the PyPI `perf-analyzer` package is an empty placeholder) and
    give it the libb64 and libcudart it links, which the nvidia-pytriton wheel ships under other names."""
    try:
        import pytriton
    except ImportError:
        raise DependencyMissingError("perf_analyzer needs libraries from nvidia-pytriton, which is not installed",
                                     f"pip install {pin('nvidia-pytriton')}") from None
    libs = (Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs").resolve()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PERF_ANALYZER_WHEEL,
                        "--dest", tmp], check=True, timeout=300)
        wheel = next(Path(tmp).glob("tritonclient-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith("/bin/perf_analyzer"))
            TOOLS.mkdir(parents=True, exist_ok=True)
            target = TOOLS / "perf_analyzer"
            with atomic_path(target, executable=True) as partial:  # a copy that is running keeps its file
                partial.write_bytes(archive.read(member))
    (TOOLS / "lib").mkdir(exist_ok=True)
    for pattern, name in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        link = TOOLS / "lib" / name
        link.unlink(missing_ok=True)
        link.symlink_to(next(libs.glob(pattern)))
    tool = PerfAnalyzer(target, TOOLS / "lib")
    subprocess.run([str(target), "--version"], check=True, capture_output=True, env=tool.environment(), timeout=60)
    return PerfAnalyzer(write_wrapper(WRAPPER, target, TOOLS / "lib"))


def write_wrapper(wrapper: Path, executable: Path, libraries: Path) -> Path:
    """A shell script at `wrapper` that runs `executable` with `libraries` on the library path, so that
    `perf_analyzer` works as typed."""
    folder, binary = (shlex.quote(str(path.resolve())) for path in (libraries, executable))
    return write_text(wrapper, "#!/bin/sh\n# Written by `workbench install-perf-analyzer`: perf_analyzer with the "
                      "libraries it links (libb64, libcudart).\n"
                      f'LD_LIBRARY_PATH={folder}"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"\n'
                      f'export LD_LIBRARY_PATH\nexec {binary} "$@"\n')
