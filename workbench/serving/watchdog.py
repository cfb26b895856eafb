"""A server's watchdog: `python -m workbench.serving.watchdog PARENT GROUP [FOLDER...]`, started beside each
tritonserver in a session of its own. When the process that started the server dies, however it dies (SIGKILL
included), the watchdog stops the server's process group (the server and its Python-backend stubs: SIGTERM, then
SIGKILL) and removes FOLDERs; when the group ends first, it just exits."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time

POLL_S = 0.2
GRACE_S = 10.0  # between SIGTERM and SIGKILL


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(parent: int, group: int, folders: list[str]) -> None:
    while os.getppid() == parent:  # reparented: the parent is gone
        if not group_alive(group):
            return
        time.sleep(POLL_S)
    for signum, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while group_alive(group) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
