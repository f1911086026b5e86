"""Whether an :class:`~rlserve.engine.front.async_engine.AsyncEngine`'s replicas can serve, and why not:
alive (every replica's thread or engine-core process runs), ended now (from the kernel, for ``/health``),
restarting (:mod:`rlserve.engine.front.core_restart`) or dead, with the reason. Mixed into ``AsyncEngine``:
reads its ``_closed`` (why the server closed, or None), ``_replicas`` and ``restarter``."""

from __future__ import annotations


class ReplicaHealth:
    """The liveness queries of :class:`~rlserve.engine.front.async_engine.AsyncEngine`."""

    def is_alive(self) -> bool:
        """True while every replica runs (its thread, or its engine-core process)."""
        return self._closed is None and all(r.alive for r in self._replicas)

    def ended_now(self) -> str | None:
        """Why a replica that still reads as alive cannot serve, from the kernel now (its
        engine-core process killed, exiting or exited; its reader thread says so a moment
        later); ``None`` when none. ``/health`` asks this (one ``/proc`` read per replica); the
        request path keeps :meth:`is_alive`'s flags."""
        for r in self._replicas:
            ended = getattr(r, "ended_now", None)
            why = ended() if ended is not None and r.alive else None
            if why is not None:
                return why
        return None

    def will_restart(self) -> bool:
        """Whether a replica that dies now is restarted (the server is open, restarts are on
        and the restarter has not given up)."""
        return self._closed is None and self.restarter is not None and self.restarter.gave_up is None

    def is_restarting(self) -> bool:
        """True while a dead replica's engine core is being (or about to be) restarted: the
        server is open, restarts are on and the restarter has not given up (``/health`` says
        ``restarting``, not ``dead``)."""
        return (self._closed is None and self.restarter is not None and self.restarter.gave_up is None
                and not all(r.alive for r in self._replicas))

    def dead_reason(self) -> str | None:
        """Why :meth:`is_alive` is False (None while alive)."""
        if self._closed is not None:
            return self._closed
        if self.restarter is not None and self.restarter.gave_up is not None:
            return self.restarter.gave_up
        for r in self._replicas:
            if not r.alive:
                why = getattr(r, "death", None) or f"engine replica {r.index} is not running"
                if self.restarter is not None and r.index in self.restarter.restarting:
                    why += " (being restarted)"
                return why
        return None
