"""`EngineSupervisor`: keeps a model server run as a child process alive for an `OpenAIPolicy`.

A policy created with ``supervisor=EngineSupervisor(server)`` hands every failed request to
the supervisor before `BatchedPolicy` retries it. The supervisor finds out what went wrong and
repairs it:

* **dead**: the server process exited (a crash, the OOM killer, ``kill -9``), or its port
  refuses connections;
* **hung**: its health route does not answer within ``health_timeout_s``, or
  ``hung_after_timeouts`` requests in a row timed out although the health route answers (a
  stuck generation loop behind a live HTTP front end).

Then it kills what is left of the server, starts it again on the same port, and has the
policy's `WeightPublisher` load the last weights it published (it remembers the folder and the
version of the last `OpenAIPolicy.load_weights`; ``recover(..., reload=publisher.republish)``),
so the restarted server serves that version and its answers report it.
The batch that failed is sent again by `BatchedPolicy`'s own retry (``max_attempts``), each
completion continued from the tokens it had streamed before the crash (prompt + prefix as the
new prompt: none is sampled twice, see `OpenAIPolicy`, "Resume from the prefix"); what
still fails is delivered as a flagged fallback (``fallback=True``, no text: learners never
train on it, nor on the part of it generated before the crash). More than ``max_restarts`` restarts within
``restart_window_s`` means the server cannot be kept alive: the supervisor gives up and every
request fails at once (flagged fallbacks), so nothing waits forever.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from asyncvec.inference.serving.server_process import ServerProcess
from asyncvec.inference.types import BackendError, TransientBackendError


class EngineSupervisor:
    """Detects a dead or hung model server, restarts it and has the policy reload its weights.

    Give it to the policy that uses the server: ``OpenAIPolicy(server.url, ...,
    supervisor=EngineSupervisor(server))``. The server must have been started (e.g. ``with
    server:``); whoever started it stops it, whichever process is running by then.

    Args:
        server: the `ServerProcess` (`AsyncvecServer`, `VLLMServer`) serving the policy.
        health_timeout_s: how long the health route may take to answer before the server
            counts as hung.
        hung_after_timeouts: consecutive request timeouts, with the health route answering,
            after which the server counts as hung anyway.
        max_restarts: most restarts within ``restart_window_s``; one more failure gives up.
        restart_window_s: the window of ``max_restarts``.
        startup_timeout_s: longest wait for the restarted server (default: the server's own
            ``startup_timeout_s``).

    Example:
        >>> import sys
        >>> server = ServerProcess([sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
        ...                        health_path="/")
        >>> with server:
        ...     supervisor = EngineSupervisor(server, health_timeout_s=5)
        ...     print(supervisor.diagnose(TransientBackendError("read timed out")))  # it answers: not hung yet
        ...     server.kill()  # a crash
        ...     print(supervisor.diagnose(TransientBackendError("connection refused")))
        ...     restarted = supervisor.recover(TransientBackendError("connection refused"), supervisor.generation)
        ...     print(restarted, server.running, supervisor.stats()["engine_restarts"])
        None
        exited
        True True 1
    """

    def __init__(
        self,
        server: ServerProcess,
        *,
        health_timeout_s: float = 10.0,
        hung_after_timeouts: int = 2,
        max_restarts: int = 5,
        restart_window_s: float = 600.0,
        startup_timeout_s: float | None = None,
    ) -> None:
        if not isinstance(server, ServerProcess):
            raise TypeError(f"EngineSupervisor: server must be a ServerProcess, got {type(server).__name__}")
        for field, value in (("health_timeout_s", health_timeout_s), ("restart_window_s", restart_window_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"EngineSupervisor: {field} must be a number > 0, got {value!r}")
        for field, count in (("hung_after_timeouts", hung_after_timeouts), ("max_restarts", max_restarts)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"EngineSupervisor: {field} must be an int >= 1, got {count!r}")
        if startup_timeout_s is not None and (
            isinstance(startup_timeout_s, bool)
            or not isinstance(startup_timeout_s, (int, float))
            or not startup_timeout_s > 0
        ):
            raise ValueError(
                f"EngineSupervisor: startup_timeout_s must be a number > 0 or None, got {startup_timeout_s!r}"
            )
        self.server = server
        self.health_timeout_s = float(health_timeout_s)
        self.hung_after_timeouts = hung_after_timeouts
        self.max_restarts = max_restarts
        self.restart_window_s = float(restart_window_s)
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()  # one diagnosis/restart at a time; batches wait on it
        self._generation = 0
        self._timeouts_in_a_row = 0
        self._restarted_at: deque[float] = deque()
        self._gave_up: str | None = None
        self._counts = {"engine_failures": 0, "engine_restarts": 0, "engine_restart_failures": 0}
        self.last_failure: str | None = None
        """why the last restart happened (``"exited"``, ``"unreachable"``, ``"hung"``), None before any"""

    @property
    def url(self) -> str:
        """The supervised server's root URL."""
        return self.server.url

    @property
    def generation(self) -> int:
        """How many times the server was restarted; waits for a restart in progress first."""
        with self._lock:
            return self._generation

    def check_alive(self) -> None:
        """Raise `TransientBackendError` if the server process exited, `BackendError` after giving up."""
        if self._gave_up is not None:
            raise BackendError(self._gave_up)
        if not self.server.running:
            code = None if self.server.process is None else self.server.process.poll()
            raise TransientBackendError(f"{self.server.name} at {self.url} exited (code {code})")

    def request_succeeded(self) -> None:
        """A request was answered: the timeouts-in-a-row count starts again."""
        self._timeouts_in_a_row = 0

    def diagnose(self, error: BaseException) -> str | None:
        """What ``error`` says about the server: ``"exited"``, ``"unreachable"``, ``"hung"``, or
        None (it is alive and answering: a retry, not a restart). Probes the health route; a
        timeout counts toward ``hung_after_timeouts`` (reset by `request_succeeded` and by a restart)."""
        if not self.server.running:
            return "exited"
        import httpx

        try:
            response = httpx.get(self.url + self.server.health_path, timeout=self.health_timeout_s)
        except httpx.TimeoutException:
            return "hung"
        except httpx.HTTPError:
            return "unreachable"
        if response.status_code != 200:
            return "unreachable"
        if _is_timeout(error):
            self._timeouts_in_a_row += 1
            if self._timeouts_in_a_row >= self.hung_after_timeouts:
                return "hung"
        return None

    def recover(self, error: BaseException, generation: int, reload: Callable[[], None] | None = None) -> bool:
        """Repair the server after ``error`` of a request sent at ``generation``; True if the
        server was restarted since then (the request was lost with it and may be sent again).

        If the server was restarted since ``generation`` (by another batch), nothing more is done.
        Else it is diagnosed and, when dead or hung, restarted and ``reload`` (the policy's
        `WeightPublisher.republish`: its last weights again) is called, all before any other
        batch is sent.

        Raises:
            BackendError: the restart or the reload failed, or the supervisor gave up after
                ``max_restarts`` restarts within ``restart_window_s`` (not retried: the
                batch's requests become flagged fallbacks or fail).
        """
        with self._lock:
            if self._gave_up is not None:
                raise BackendError(self._gave_up)
            if generation != self._generation:
                return True  # another batch already had it restarted: just send it again
            reason = self.diagnose(error)
            if reason is None:
                return False
            self._counts["engine_failures"] += 1
            self.last_failure = reason
            now = time.monotonic()
            while self._restarted_at and now - self._restarted_at[0] > self.restart_window_s:
                self._restarted_at.popleft()
            if len(self._restarted_at) >= self.max_restarts:
                self._gave_up = (
                    f"{self.server.name} at {self.url} failed again ({reason}) after {self.max_restarts} restarts "
                    f"within {self.restart_window_s:g} s; the supervisor gave up (last error: {error})"
                )
                self.server.kill()
                raise BackendError(self._gave_up)
            self._restarted_at.append(now)
            self._timeouts_in_a_row = 0
            self._generation += 1  # whatever happens next, requests sent before are from another life
            try:
                self.server.kill()  # what is left of it: a hung process, or its orphaned children
                self.server.start(wait=False)
                self.server.wait_ready(self.startup_timeout_s)
                if reload is not None:
                    reload()
            except Exception as exc:
                self._counts["engine_restart_failures"] += 1
                self.server.kill()
                raise BackendError(
                    f"{self.server.name} at {self.url} was {reason} and could not be restarted: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            self._counts["engine_restarts"] += 1
            return True

    def stats(self) -> dict[str, float]:
        """``engine_failures`` (dead or hung, detected), ``engine_restarts`` (done, weights
        reloaded), ``engine_restart_failures``, ``engine_gave_up`` (0 or 1)."""
        return {**self._counts, "engine_gave_up": int(self._gave_up is not None)}

    def __repr__(self) -> str:
        return f"EngineSupervisor({self.server!r}, restarts={self._counts['engine_restarts']})"


def _is_timeout(error: BaseException) -> bool:
    cause: BaseException | None = error
    while cause is not None:
        if "Timeout" in type(cause).__name__ or "timed out" in str(cause) or "no answer within" in str(cause):
            return True
        cause = cause.__cause__
    return False
