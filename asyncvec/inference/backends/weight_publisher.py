"""`WeightPublisher`: publishes weights to one model server, and publishes the latest again after
the server was restarted.

A publish goes one way: `OpenAIPolicy.load_weights` -> `WeightPublisher.publish` (checkpoint
written and checked here) -> the server's `ServerRoutes` -> its `ServerClient`. With an
`EngineSupervisor`, a publish that meets a dead server and a batch that does both go through
`WeightPublisher.recover`: the supervisor restarts the server and, before anything else is sent,
calls `WeightPublisher.republish` (the latest published folder, as its version).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncvec.inference.backends.server_client import is_transient
from asyncvec.inference.weights import ParameterSpec, checkpoint_shapes, write_checkpoint

if TYPE_CHECKING:
    from asyncvec.inference.backends.server_routes import PublishTimings, ServerRoutes
    from asyncvec.inference.serving.supervisor import EngineSupervisor


class WeightPublisher:
    """Loads weights into one server through its routes; remembers the latest for a restart.

    Args:
        routes: the server's `ServerRoutes` (``ROUTES[server_kind](client, ...)``).
        model: the served model name (names the checkpoints written here).
        checkpoint_dir: where state dicts and modules given to `publish` are written, as
            ``<model>-v<version>`` folders (None: only checkpoint folders are accepted).
        keep_checkpoints: how many written checkpoints to keep (older ones are deleted).
        model_dir: the served model's folder: checkpoints are checked against its parameter
            names and shapes, and its config is copied into the ones written here.
        supervisor: the server's `EngineSupervisor`, if it restarts the server.
    """

    def __init__(
        self,
        routes: ServerRoutes,
        *,
        model: str,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keep_checkpoints: int = 2,
        model_dir: str | os.PathLike[str] | None = None,
        supervisor: EngineSupervisor | None = None,
    ) -> None:
        self.routes = routes
        self.client = routes.client
        self.model = model
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.supervisor = supervisor
        self._parameters = ParameterSpec.from_model_dir(self.model_dir) if self.model_dir is not None else None
        self._latest: tuple[str, int] | None = None
        self._identified = False
        self._written: list[Path] = []
        self._checked: tuple[str, int] | None = None  # the (folder, version) whose version `prepare` checked
        self._prepare_s: dict[str, float] = {}
        self.frozen_s: list[float] = []
        """per publish: how long the server held generation still (``frozen_s`` of `ServerRoutes.publish`'s timings)"""
        self.last_publish: PublishTimings = {}
        """seconds each step of the last successful `send` took: the server's update (`ServerRoutes.publish`)
        and `prepare`'s ``checkpoint_s`` and ``check_s``"""

    @property
    def latest(self) -> tuple[str, int] | None:
        """The folder and version of the last successful `publish` (None before the first)."""
        return self._latest

    @property
    def _timeout_s(self) -> float:
        return self.client.update_timeout_s + 30.0

    def identify(self) -> dict[str, Any]:
        """Ask the server what it is (`ServerRoutes.identify`); raise `BackendRejectedError` if it is
        not of the routes' kind. Returns what the server said."""
        info: dict[str, Any] = self.client.run(self.routes.identify())
        self._identified = True
        return info

    def server_version(self) -> int | None:
        """The weight version the server reports now (None: it has none yet)."""
        version: int | None = self.client.run(self.routes.read_version())
        return version

    def publish(self, weights: Any, version: int) -> PublishTimings:
        """Load ``weights`` (a checkpoint folder the server can read, or a state dict / module
        written to ``checkpoint_dir``) into the server as ``version``: `prepare`, then `send`.
        Returns how long its steps took (as `send`)."""
        return self.send(self.prepare(weights, version), version)

    def prepare(self, weights: Any, version: int) -> str:
        """The part of a publish that holds nothing back, done before generation is paused: the server
        is identified (the first time), the checkpoint written and checked, and the server's version
        read (it must be older than ``version``; if the server cannot be reached, `send` reads it).
        Returns the folder to `send`."""
        if not self._identified:
            self.identify()
        began = time.perf_counter()
        path = self.checkpoint_path(weights, version)
        self._prepare_s = {"checkpoint_s": time.perf_counter() - began}
        began = time.perf_counter()
        try:
            self.client.run(self.routes.check_newer(version))
        except Exception as exc:
            if not is_transient(exc):
                raise
        else:
            self._checked = (path, version)
            self._prepare_s["check_s"] = time.perf_counter() - began
        return path

    def send(self, path: str, version: int) -> PublishTimings:
        """Load the folder ``path`` (from `prepare`) into the server as ``version``. With a supervisor,
        a server found dead is restarted (and given the latest weights) and the publish sent once more.
        Returns how long its steps took (also kept as `last_publish`)."""
        supervisor = self.supervisor
        if supervisor is None:
            timings = self._send(path, version)
        else:
            generation = supervisor.generation
            try:
                supervisor.check_alive()
                timings = self._send(path, version)
            except Exception as exc:
                # a dead server: restart it (with the latest weights), then publish these once more
                if not is_transient(exc) or not self.recover(exc, generation):
                    raise
                self._checked = None
                timings = self._send(path, version)
        self.last_publish = {**timings, **self._prepare_s}
        self._latest = (path, version)
        self._prune_checkpoints()
        return self.last_publish

    def republish(self) -> None:
        """Load the latest published weights again (into a restarted server); nothing before the first."""
        if self._latest is not None:
            self._send(*self._latest)

    def recover(self, error: BaseException, generation: int) -> bool:
        """Have the supervisor repair the server after ``error`` of a request sent at ``generation``,
        republishing the latest weights if it restarts it (`EngineSupervisor.recover`); True if the
        server was restarted since ``generation`` (always False without a supervisor)."""
        if self.supervisor is None:
            return False
        return self.supervisor.recover(error, generation, reload=self.republish)

    def _send(self, path: str, version: int) -> PublishTimings:
        checked, self._checked = self._checked == (path, version), None
        timings: PublishTimings = self.client.run(
            self.routes.publish(path, version, checked=checked), timeout_s=self._timeout_s
        )
        if "frozen_s" in timings:
            self.frozen_s.append(timings["frozen_s"])
        return timings

    # ----------------------------------------------------------------------- checkpoints
    def checkpoint_path(self, weights: Any, version: int) -> str:
        """The folder the server loads ``weights`` from: ``weights`` itself if it is a path (checked
        unless the server is ``asyncvec``, which checks paths itself and survives bad ones), else a
        checkpoint written to ``checkpoint_dir`` and checked."""
        label = self.routes.label
        if isinstance(weights, (str, os.PathLike)):
            path = os.fspath(weights)
            if self.routes.kind != "asyncvec":
                self._check_checkpoint(Path(path))
            return path
        if self.checkpoint_dir is None:
            raise TypeError(
                f"{label}.load_weights got a {type(weights).__name__}: pass a checkpoint folder the server "
                "can read, or create the policy with checkpoint_dir=<a folder the server can read> to write one"
            )
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model)
        folder = write_checkpoint(weights, self.checkpoint_dir / f"{name}-v{version}", config_from=self.model_dir)
        self._written.append(folder)
        self._check_checkpoint(folder)
        return str(folder.resolve())

    def _check_checkpoint(self, folder: Path) -> None:
        shapes = checkpoint_shapes(folder)
        spec = self._parameters
        if spec is None and (folder / "config.json").is_file():
            spec = ParameterSpec.from_model_dir(folder)
        if spec is None:
            return
        where = f"{self.routes.label}: checkpoint {str(folder)!r}"
        spec.check(shapes, where=where)
        if self.routes.kind == "vllm":
            missing = {name: source for name, source in spec.tied.items() if name not in shapes}
            if missing:
                raise ValueError(
                    f"{where} lacks tied tensors {missing} (name: tied to): vLLM reloads each parameter from its "
                    "own name and would keep the old ones; write the folder with asyncvec.inference.write_checkpoint"
                )

    def _prune_checkpoints(self) -> None:
        while len(self._written) > self.keep_checkpoints:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)

    def __repr__(self) -> str:
        return f"WeightPublisher({self.client.base_url!r}, kind={self.routes.kind!r}, latest={self._latest!r})"
