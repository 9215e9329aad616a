"""A wall-clock step on the worker machine, for the fault matrix's ``clock_step_back`` cell.

The system clock cannot be changed here (nor should a test change it), so the step is made
where the processes read it: ``clockstep.c``, preloaded into every worker and claimer process
(``LD_PRELOAD``, inherited by prefork pool processes), adds the offset written to a file to
every wall-clock read, and leaves the monotonic clock alone, as a real step does. Writing
``-60`` to the file steps those processes' clocks back a minute within 100 ms.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from .services import ServiceError

SOURCE = Path(__file__).with_name("clockstep.c")


def build_shim() -> Path:
    """The shared library, built once per source text with the system's C compiler (cached
    in the temp directory)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ServiceError("the clock step needs a C compiler (cc) to build its LD_PRELOAD shim")
    text = SOURCE.read_bytes()
    digest = hashlib.sha256(text).hexdigest()[:12]
    lib = Path(tempfile.gettempdir()) / f"chaos-clockstep-{digest}.so"
    if not lib.exists():
        part = lib.with_suffix(".part")
        done = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(part), str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise ServiceError(f"building the clock shim failed: {done.stderr[-800:]}")
        part.rename(lib)
    return lib


class ClockStep:
    """The offset file and the environment that preloads the shim reading it."""

    def __init__(self, logdir: Path) -> None:
        self.lib = build_shim()
        self.file = logdir / "clock-offset"
        self.set(0.0)

    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": str(self.lib), "CHAOS_CLOCK_FILE": str(self.file)}

    def set(self, seconds: float) -> None:
        part = self.file.with_suffix(".part")
        part.write_text(f"{seconds}\n")
        part.replace(self.file)  # a reader sees the old offset or the new one, never half
