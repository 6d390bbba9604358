"""The console's refusals: answered as JSON ``{"error": ...}`` with their status."""

from __future__ import annotations


class ConsoleError(Exception):
    """A request the console refuses; ``message`` is shown to the viewer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
