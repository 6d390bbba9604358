"""Who is looking: the :class:`Viewer` of a request, from the console's access mode.

``none``: everyone is the operator who port-forwarded (every namespace);
``tokenreview``: not served yet (401) until token reviews are implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gpuslice_inventory.console.errors import ConsoleError


@dataclass(frozen=True)
class Viewer:
    """A viewer and the namespaces it may see (None: every namespace)."""

    user: str
    namespaces: frozenset[str] | None


PORT_FORWARD = Viewer("port-forward", None)


async def authenticate(request: Request) -> Viewer:
    """The request's viewer (a FastAPI dependency); 401 when it cannot be told."""
    mode = getattr(request.app.state, "console_auth", "tokenreview")
    if mode == "none":
        return PORT_FORWARD
    raise ConsoleError(401, "token review is not available on this console yet")
