"""NVIDIA's perf_analyzer: find it (PATH, or the copy in this environment) and install it from a tritonclient wheel.
Running a measurement with it is load generation: `workbench.load.perf_analyzer_level`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import DependencyMissingError
from workbench.pins import pin

# A deliberate pin of its own, not the project's tritonclient: the newest wheel whose perf_analyzer runs on glibc 2.36
# (Debian 12). Only its binary is taken; the Python package stays the one pyproject.toml pins.
PERF_ANALYZER_WHEEL = "tritonclient==2.48.0"
TOOLS = Path(sys.prefix) / "tools" / "perf_analyzer"


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


def find_perf_analyzer() -> PerfAnalyzer | None:
    """perf_analyzer on PATH (NVIDIA's SDK container), or the copy `workbench install-perf-analyzer` made."""
    on_path = shutil.which("perf_analyzer")
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
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PERF_ANALYZER_WHEEL,
                        "--dest", tmp], check=True, timeout=300)
        wheel = next(Path(tmp).glob("tritonclient-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith("/bin/perf_analyzer"))
            TOOLS.mkdir(parents=True, exist_ok=True)
            target = TOOLS / "perf_analyzer"
            target.write_bytes(archive.read(member))
    target.chmod(0o755)
    (TOOLS / "lib").mkdir(exist_ok=True)
    for pattern, name in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        link = TOOLS / "lib" / name
        link.unlink(missing_ok=True)
        link.symlink_to(next(libs.glob(pattern)))
    tool = PerfAnalyzer(target, TOOLS / "lib")
    subprocess.run([str(target), "--version"], check=True, capture_output=True, env=tool.environment(), timeout=60)
    return tool
