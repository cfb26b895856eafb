"""The sweep's board, a Ray actor on the driver's node: cells post their lines to it and read whether the driver
has cancelled them. Ray's own cancel does not reach a task waiting on its run (a sleeping task is not interrupted),
and its log forwarding repeats each line once per node of a host; the board does neither."""
from __future__ import annotations


class Board:
    """Lines waiting for the driver, in the order each cell posted them, and the driver's cancel."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stopped = False

    def say(self, line: str) -> None:
        self.lines.append(line)

    def take(self) -> list[str]:
        taken, self.lines = self.lines, []
        return taken

    def cancel(self) -> None:
        self.stopped = True

    def cancelled(self) -> bool:
        return self.stopped
