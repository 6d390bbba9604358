"""A refused admission: the message its author reads, and the Status it is given."""

from __future__ import annotations

__all__ = ["Denied", "bad_request"]


class Denied(Exception):
    """The pod is refused; ``message`` is what its author reads.

    ``code`` and ``reason`` fill the AdmissionReview's Status: 400 BadRequest for
    a malformed request, 403 Forbidden for one the policy refuses, 503
    ServiceUnavailable when what admission needs cannot be read.
    """

    def __init__(self, message: str, code: int = 403, reason: str = "Forbidden") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason


def bad_request(message: str) -> Denied:
    return Denied(message, 400, "BadRequest")
