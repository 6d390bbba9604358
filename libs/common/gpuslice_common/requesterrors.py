"""The errors of reading a pod's GPU request (:mod:`gpuslice_common.requests`)."""

from __future__ import annotations


class RequestError(ValueError):
    """A pod's GPU request is malformed or out of range; the message says where and why."""


class QuantityTooLarge(RequestError):
    """A well-formed, positive quantity too large for :func:`parse_quantity` to work
    with (above 1e30, or a positive exponent beyond 64): it reads as more than any
    bound a caller sets."""


__all__ = ["QuantityTooLarge", "RequestError"]
