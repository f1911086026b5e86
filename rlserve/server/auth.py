"""Bearer-key checks, as FastAPI dependencies.

* ``--api-key`` protects generation routes (``/v1/*`` and TRL's ``/generate/``).
* ``--admin-key`` protects control routes (pause/resume, prefix-cache reset, abort, weight
  sync). Without an admin key, control routes are served only on a loopback bind; on any
  other bind they answer 403, so a server reachable from the network cannot be paused or
  have its weights replaced by anyone who can reach it -- unless ``--insecure-control-routes``
  (default on with env ``VLLM_SERVER_DEV_MODE=1``, which `trl vllm-serve` sets) asks for vLLM's
  behaviour: its dev-mode routes (pause, weight transfer, prefix-cache reset) take no key, its
  ``--api-key`` guards only ``/v1``. The server then logs a warning at startup.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from rlserve.server.errors import APIError
from rlserve.server.state import ServerSettings, is_loopback


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def require_api_key(settings: ServerSettings):
    """Dependency: 401 unless ``Authorization: Bearer <api_key>`` (no-op without a key)."""

    async def check(request: Request) -> None:
        if settings.api_key is None:
            return
        token = _bearer(request)
        if token is None:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>' (the server runs with --api-key).",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return check


def require_admin(settings: ServerSettings):
    """Dependency for control routes: Bearer ``admin_key`` when one is set (401
    otherwise); with no admin key, 403 unless the server is bound to loopback or runs with
    ``--insecure-control-routes``."""

    async def check(request: Request) -> None:
        if settings.admin_key is None:
            if is_loopback(settings.host) or settings.insecure_control_routes:
                return
            raise APIError(403, f"control routes are disabled: the server is bound to {settings.host!r} (not "
                                "loopback) without --admin-key. Restart with --admin-key KEY and send "
                                "'Authorization: Bearer KEY', or bind to 127.0.0.1, or (vLLM's dev mode, what "
                                "`trl vllm-serve` sets) start it with VLLM_SERVER_DEV_MODE=1 or "
                                "--insecure-control-routes to serve them without a key.",
                           code="admin_key_required")
        token = _bearer(request)
        if token is None or not hmac.compare_digest(token.encode(), settings.admin_key.encode()):
            raise APIError(401, "control routes need 'Authorization: Bearer <admin key>' (--admin-key)",
                           code="invalid_admin_key")

    return check
