"""Stop requests for a training run: SIGINT and SIGTERM set a flag that the loop checks at safe
points, so a run always stops between optimizer steps with a state that can be saved whole.

A second signal, a second or more after the first, stops at once (``KeyboardInterrupt`` wherever
the run is): the way out of a step that takes too long, at the price of no new checkpoint. Signals
closer together count as one request, because one Ctrl-C often arrives twice: torchrun's agent
forwards the SIGINT that the terminal already sent to every worker of its process group.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCE_AFTER_S = 1.0  # a repeat sooner than this is the same request delivered twice


class ForcedStop(KeyboardInterrupt):
    """A second signal arrived before the run reached a safe point."""


class StopSignals:
    """A context that turns SIGINT/SIGTERM into a stop request while it is open.

    The handler only records the signal: the loop calls ``requested`` at its safe points. Inside
    ``immediate()`` (evaluation, which changes no training state) the first signal raises
    ``KeyboardInterrupt`` at once. Handlers can only be installed from the main thread; elsewhere
    the context does nothing and signals keep their previous behaviour.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: str | None = None  # the first signal's name, e.g. "SIGTERM"
        self.forced = False
        self._received_at = 0.0
        self._immediate = False
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            try:
                for sig in self.signals:
                    self._previous[sig] = signal.signal(sig, self._handle)
            except BaseException:  # no __exit__ follows a failed __enter__: put back what changed
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:  # restores the same whatever ended the block
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.received is not None

    def request(self, name: str) -> None:
        """Record a stop request that did not come from a signal (e.g. another process's)."""
        if self.received is None:
            self.received, self._received_at = name, time.monotonic()

    def immediate(self) -> _Immediate:
        """A region where the first signal raises at once (nothing there can be torn)."""
        return _Immediate(self)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received is not None:
            if now - self._received_at < FORCE_AFTER_S:
                return
            self.forced = True
            raise ForcedStop(f"second {name}: stopped at once")
        self.received, self._received_at = name, now
        if self._immediate:
            raise KeyboardInterrupt(name)


class _Immediate:
    def __init__(self, owner: StopSignals) -> None:
        self.owner = owner
        self.outer = False

    def __enter__(self) -> None:
        if self.owner.requested:  # a request that came in just before: honour it here too
            raise KeyboardInterrupt(self.owner.received)  # before the flag: no __exit__ follows
        self.outer, self.owner._immediate = self.owner._immediate, True

    def __exit__(self, *exc_info: object) -> None:  # restores the same whatever ended the block
        self.owner._immediate = self.outer
