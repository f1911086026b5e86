"""Trainer SDK, HTTP side: :class:`HTTPWeightSyncClient`, one method per weight-sync route
(vLLM's names), and the errors a refused call raises."""

from __future__ import annotations

import json
import threading


from rlserve.errors import WeightUpdateError, WeightUpdateStateError
from rlserve.transfer.errors import NonFiniteWeightsError, TransferTimeoutError, WeightTransferFailedError
from rlserve.transfer.wire.protocol import DEFAULT_TIMEOUT_S

class WeightSyncHTTPError(WeightUpdateError):
    """The server answered an error. Attributes: ``status_code``, ``error_type``, ``message``,
    ``route``, ``code`` (the error's machine-readable code, e.g. ``"no_transfer_engine"``)."""

    def __init__(self, route: str, status_code: int, message: str, error_type: str | None = None,
                 code: str | None = None):
        super().__init__(f"{route} -> HTTP {status_code} ({error_type or 'error'}): {message}")
        self.route, self.status_code, self.message, self.error_type = route, status_code, message, error_type
        self.code = code


class WeightSyncConflictError(WeightSyncHTTPError, WeightUpdateStateError):
    """HTTP 409: the call arrived out of order."""


class WeightsRefusedNonFiniteError(WeightSyncHTTPError, NonFiniteWeightsError):
    """HTTP 400 ``non_finite_weights``: the server found NaN / inf in a synced tensor (named in
    ``message``) and refused the update; staged servers keep their old weights, in-place ones
    answer 503 until a complete good update. Catch it as either class."""


class HTTPWeightSyncClient:
    """Client of the server's weight-sync control routes (``requests``, JSON only).

    Args:
        base_url: e.g. ``"http://localhost:8000"``.
        admin_key: sent as ``Authorization: Bearer <key>`` (the server's ``--admin-key``).
        timeout_s: read timeout of each call in seconds (``update_weights`` gets the larger of
            this and the value the engine passes); connecting is limited to 10 s.

    Every method raises :class:`WeightSyncHTTPError` (409: :class:`WeightSyncConflictError`; 400
    ``non_finite_weights``: :class:`WeightsRefusedNonFiniteError`)
    with the server's JSON error message on 4xx/5xx, and :class:`WeightTransferFailedError`
    when the server cannot be reached.
    """

    connect_timeout_s = 10.0

    def __init__(self, base_url: str, admin_key: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.timeout_s = float(timeout_s)
        self._local = threading.local()  # one keep-alive requests.Session per calling thread

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.admin_key:
            h["Authorization"] = f"Bearer {self.admin_key}"
        return h

    def _http(self):
        """This thread's ``requests.Session`` (calls run concurrently from several threads; a
        session per thread keeps its connection alive: no TCP connect per call)."""
        import requests

        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _call(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        import requests

        url = f"{self.base_url}{route}"
        timeout = (self.connect_timeout_s, max(self.timeout_s, timeout_s or 0.0))
        # the standard library's C encoder: requests' own json= path may pick simplejson, which
        # took ~4 ms for an update_info of 399 ipc handles
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            r = self._http().request(method, url, data=data, headers=self._headers(), timeout=timeout)
        except requests.Timeout as e:
            raise TransferTimeoutError(f"{route}: no answer from {self.base_url} within {timeout[1]:.0f} s") from e
        except requests.RequestException as e:
            raise WeightTransferFailedError(f"{route}: cannot reach {self.base_url}: {e}") from e
        if r.status_code >= 400:
            msg, etype, code = r.text[:2000], None, None
            try:
                j = r.json()
                err = j.get("error", j) if isinstance(j, dict) else {}
                if isinstance(err, dict):
                    msg = err.get("message") or err.get("detail") or msg
                    etype = err.get("type")
                    code = err.get("code") if isinstance(err.get("code"), str) else None
                elif isinstance(err, str):
                    msg = err
            except ValueError:
                pass
            cls = WeightSyncConflictError if r.status_code == 409 else \
                WeightsRefusedNonFiniteError if code == NonFiniteWeightsError.code else WeightSyncHTTPError
            raise cls(route, r.status_code, str(msg), etype, code)
        try:
            return r.json() if r.content else {}
        except ValueError:
            return {"text": r.text}

    # vLLM-style control plane
    def get_world_size(self) -> int:
        """Server workers (TP * DP); the transfer group is this + 1."""
        return int(self._call("GET", "/get_world_size")["world_size"])

    def init_weight_transfer_engine(self, init_info: dict, timeout_s: float | None = None) -> dict:
        return self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info}, timeout_s)

    #: The transfer group incarnation (``init_info.session``) this client's update calls belong
    #: to; the trainer engine sets it at each init. The server refuses (409 ``stale_session``)
    #: calls of a session another init has replaced. ``None``: not sent.
    session: str | None = None

    def _session_body(self, body: dict) -> dict:
        if self.session:
            body["session"] = self.session
        return body

    def start_weight_update(self, update_info: dict | None = None) -> dict:
        return self._call("POST", "/start_weight_update",
                          self._session_body({"update_info": update_info} if update_info else {}))

    def update_weights(self, update_info: dict, timeout_s: float | None = None) -> dict:
        return self._call("POST", "/update_weights", self._session_body({"update_info": update_info}), timeout_s)

    def sync_weights(self, update_info: dict, weight_version: str | None = None,
                     timeout_s: float | None = None) -> dict:
        """rlserve's one-call update (start + update + finish): ``POST /sync_weights``."""
        body = {"update_info": update_info}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._call("POST", "/sync_weights", self._session_body(body), timeout_s)

    def finish_weight_update(self, weight_version: str | None = None, timeout_s: float | None = None) -> dict:
        body = {} if weight_version is None else {"weight_version": str(weight_version)}
        return self._call("POST", "/finish_weight_update", self._session_body(body), timeout_s)

    def shutdown_weight_transfer_engine(self) -> dict:
        return self._call("POST", "/shutdown_weight_transfer_engine", {})

    def weight_info(self) -> dict:
        return self._call("GET", "/weight_info")

    def weight_checker(self, compare: dict[str, str] | None = None) -> dict:
        return self._call("POST", "/weight_checker", {"compare": compare} if compare else {})

    def pause(self, mode: str = "abort", clear_cache: bool = False) -> dict:
        """``POST /pause``; the same default as the route (and vLLM's): ``abort`` ends the requests in
        flight; ``keep`` freezes them and continues them after :meth:`resume`; ``wait`` lets them
        finish first."""
        return self._call("POST", f"/pause?mode={mode}&clear_cache={str(clear_cache).lower()}", {})

    def resume(self) -> dict:
        return self._call("POST", "/resume", {})

    # sleep mode (a server started with --enable-sleep-mode; vLLM's routes)
    def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """``POST /sleep``: free the server's GPU memory (level 1: weights kept in host memory;
        2: discarded, the next ``send_weights()`` refills them). Returns the sleep state.
        Raises WeightSyncConflictError (409) while asleep or during an update."""
        return self._call("POST", f"/sleep?level={int(level)}&mode={mode}", {})

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """``POST /wake_up`` (``tags``: ``"weights"``, ``"kv_cache"``; default both). Raises
        WeightSyncConflictError (409 ``not_sleeping``) when none of them sleeps."""
        query = "&".join(f"tags={t}" for t in tags or [])
        return self._call("POST", "/wake_up" + (f"?{query}" if query else ""), {})

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    # TRL-style
    def init_communicator(self, host: str, port: int, world_size: int, wire: str | None = None) -> dict:
        body = {"host": host, "port": port, "world_size": world_size}
        if wire is not None:
            body["wire"] = wire  # "rlserve": rlserve's data plane, not vLLM's (see TRLWeightSyncClient)
        return self._call("POST", "/init_communicator/", body)

    def update_named_param(self, name: str, dtype: str, shape: list[int]) -> dict:
        return self._call("POST", "/update_named_param/", {"name": name, "dtype": dtype, "shape": list(shape)})

    def reset_prefix_cache(self) -> dict:
        return self._call("POST", "/reset_prefix_cache/", {})

    def close_communicator(self) -> dict:
        return self._call("POST", "/close_communicator/", {})


#: vLLM's name, for scripts ported from vLLM.
HTTPVLLMWeightSyncClient = HTTPWeightSyncClient
