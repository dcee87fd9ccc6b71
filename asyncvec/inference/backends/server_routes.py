"""How each kind of OpenAI-compatible server (``asyncvec serve``, vLLM, SGLang) reports the weights'
version and takes new weights: one `ServerRoutes` subclass per kind (``ROUTES[server_kind]``), which
talks to the server through a `ServerClient`; used by `OpenAIPolicy` and its `WeightPublisher`."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncvec.inference.types import BackendError, BackendRejectedError, TransientBackendError

if TYPE_CHECKING:
    from asyncvec.inference.backends.server_client import ServerClient

SERVER_KINDS = ("asyncvec", "vllm", "sglang")
#: vLLM's token-in-token-out route (``--enable-scale-out``): answers carry per-token weight-version spans
GENERATE_ROUTE = "/inference/v1/generate"

PublishTimings = dict[str, float]
"""What `ServerRoutes.publish` returns: seconds each step took (``check_s``, ``pause_s``, ``reload_s``,
``confirm_s``); ``frozen_s``: from the pause request sent to the resume answered (generation of running
requests stands still meanwhile). Empty for a server whose update is one request."""


class ServerRoutes(abc.ABC):
    """How one kind of server reports versions and takes new weights (one subclass per server kind).

    Args:
        client: the `ServerClient` of the server.
        label: who asks, in error messages (the policy's name).
        initial_version: the version a server without a numeric one serves (vLLM's ``"default"``).
        inflight: the server takes weights while requests run (vLLM ``--enable-scale-out``).
    """

    kind = ""

    def __init__(
        self, client: ServerClient, *, label: str = "OpenAIPolicy", initial_version: int = 0, inflight: bool = False
    ) -> None:
        self.client = client
        self.label = label
        self.initial_version = initial_version
        self.inflight = inflight

    @abc.abstractmethod
    async def identify(self) -> dict[str, Any]:
        """Ask the server what it is; raise BackendRejectedError if it is not this kind."""

    async def read_version(self) -> int | None:
        """``GET /weight_info`` (vLLM's route; asyncvec serves it too)."""
        info = await self.client.request("GET", "/weight_info")
        return parse_version(info.get("weight_version") if isinstance(info, dict) else None)

    async def _version_route(self, is_this_kind: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        try:
            info = await self.client.request("GET", "/version")
        except BackendRejectedError as exc:
            raise self._not_this_kind("/version", str(exc)) from None
        if not isinstance(info, dict) or not is_this_kind(info):
            raise self._not_this_kind("/version", info)
        return info

    async def batch_version(self) -> int | None:
        """Version read around each batch (None: the server reports versions in its answers)."""
        return None

    def response_version(self, data: dict[str, Any]) -> int | None:
        return None

    @abc.abstractmethod
    async def publish(self, path: str, version: int, *, checked: bool = False) -> PublishTimings:
        """Load the checkpoint folder ``path`` into the server as ``version`` (``checked``: `check_newer`
        was done already, before the caller held generation back); returns how long its steps took."""

    async def check_newer(self, version: int) -> None:
        """Raise ValueError if the server's weight version is not older than ``version``."""
        await self._check_newer(version)

    async def _check_newer(self, version: int) -> None:
        current = await self.read_version()
        if current is not None and version <= current:
            raise ValueError(
                f"{self.label}: version must be newer than the server's current weight version {current}, "
                f"got {version}; the server keeps its weights"
            )

    async def _confirm(self, version: int) -> None:
        got = await self.read_version()
        if got != version:
            raise BackendError(f"{self.client.base_url} reports weight version {got} after the update to {version}")

    def _not_this_kind(self, route: str, answer: Any) -> BackendRejectedError:
        return BackendRejectedError(
            f"{self.client.base_url} is not a server of kind {self.kind!r} (GET {route} answered {answer!r}); "
            f"create the policy with the server_kind of that server (one of {SERVER_KINDS})"
        )


class _AsyncvecRoutes(ServerRoutes):
    kind = "asyncvec"

    async def identify(self) -> dict[str, Any]:
        return await self._version_route(lambda info: info.get("server") == "asyncvec")

    def response_version(self, data: dict[str, Any]) -> int | None:
        return parse_version((data.get("metadata") or {}).get("weight_version"))

    async def publish(self, path: str, version: int, *, checked: bool = False) -> PublishTimings:
        if not checked:
            await self._check_newer(version)
        body = {"path": path, "version": version}
        client = self.client
        answer = await client.request(
            "POST", "/update_weights", json=body, update=True, timeout_s=client.update_timeout_s
        )
        if not isinstance(answer, dict) or answer.get("version") != version:
            raise BackendError(f"{client.base_url}/update_weights answered {answer!r}, expected version {version}")
        await self._confirm(version)
        return {}


class _VLLMRoutes(ServerRoutes):
    kind = "vllm"

    async def identify(self) -> dict[str, Any]:
        info = await self._version_route(lambda info: set(info) == {"version"})  # vLLM: {"version": "0.32.0"}
        try:
            await self.client.request("GET", "/weight_info")
        except BackendRejectedError as exc:
            raise BackendRejectedError(
                f"{self.client.base_url} is vLLM {info['version']} without its weight routes "
                f"(GET /weight_info: {exc}); start it with VLLM_SERVER_DEV_MODE=1 (asyncvec.inference.VLLMServer does)"
            ) from None
        if self.inflight:
            try:  # an empty body: refused by the route's validation if it is served, 403/404 if not
                await self.client.request("POST", GENERATE_ROUTE, json={})
            except (PermissionError, BackendRejectedError) as exc:
                if isinstance(exc, PermissionError) or " answered 404" in str(exc):
                    raise BackendRejectedError(
                        f"{self.client.base_url} does not serve {GENERATE_ROUTE} ({exc}), which inflight_updates=True "
                        "needs: start vLLM with --enable-scale-out (VLLMServer(..., enable_scale_out=True))"
                    ) from None
        return info

    async def batch_version(self) -> int | None:
        try:
            version = await self.read_version()
        except BackendRejectedError as exc:  # no weight routes: say how to get them
            raise BackendRejectedError(
                f"{exc}; answers of a vLLM server are tagged with GET /weight_info: start it with "
                "VLLM_SERVER_DEV_MODE=1 (asyncvec.inference.VLLMServer does)"
            ) from None
        return self.initial_version if version is None else version

    async def publish(self, path: str, version: int, *, checked: bool = False) -> PublishTimings:
        """Pause (``wait``: requests finish; in flight ``keep``: they stay frozen), reload, preempt
        the frozen requests (in flight: their prefix is recomputed with the new weights), set the
        version, resume."""
        client = self.client
        timings: PublishTimings = {}
        if not checked:
            began = time.perf_counter()
            await self._check_newer(version)
            timings["check_s"] = time.perf_counter() - began
        inflight = self.inflight
        paused = time.perf_counter()
        await client.request("POST", "/pause", params={"mode": "keep" if inflight else "wait"}, update=True)
        timings["pause_s"] = time.perf_counter() - paused
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": path, "is_checkpoint_format": True}}
            began = time.perf_counter()
            try:
                await client.request(
                    "POST", "/collective_rpc", json=rpc, update=True, timeout_s=client.update_timeout_s
                )
            except (TransientBackendError, BackendRejectedError) as exc:
                raise BackendError(
                    f"vLLM at {client.base_url} failed to reload weights from {path!r}: {exc} "
                    "(a failed reload stops vLLM's engine: check its /health)"
                ) from exc
            timings["reload_s"] = time.perf_counter() - began
            if inflight:
                reset = await client.request(
                    "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}, update=True
                )
                if not isinstance(reset, dict) or reset.get("success") is not True:
                    raise BackendError(
                        f"vLLM at {client.base_url} reloaded {path!r} but could not preempt its running requests "
                        f"(POST /reset_prefix_cache?reset_running_requests=true answered {reset!r}); the weight "
                        "version was not changed"
                    )
            await client.request("POST", "/update_weight_version", json={"new_version": str(version)}, update=True)
        finally:
            try:
                await client.request("POST", "/resume", update=True)
            except (TransientBackendError, BackendRejectedError):
                pass  # the error that stopped the update is the one to report
            timings["frozen_s"] = time.perf_counter() - paused
        began = time.perf_counter()
        await self._confirm(version)
        timings["confirm_s"] = time.perf_counter() - began
        return timings


class _SGLangRoutes(ServerRoutes):
    kind = "sglang"
    _info_routes = ("/model_info", "/get_model_info", "/get_weight_version")

    async def identify(self) -> dict[str, Any]:
        for route in self._info_routes:
            try:
                info = await self.client.request("GET", route)
            except BackendRejectedError:
                continue
            if isinstance(info, dict) and "weight_version" in info:
                return info
        raise self._not_this_kind(" or ".join(self._info_routes), "no weight_version")

    async def read_version(self) -> int | None:
        info = await self.identify()
        return parse_version(info.get("weight_version"))

    def response_version(self, data: dict[str, Any]) -> int | None:
        version = parse_version((data.get("metadata") or {}).get("weight_version"))
        return self.initial_version if version is None else version

    async def publish(self, path: str, version: int, *, checked: bool = False) -> PublishTimings:
        client = self.client
        if not checked:
            await self._check_newer(version)
        await client.request("POST", "/pause_generation", update=True)
        try:
            body = {"model_path": path, "weight_version": str(version)}
            answer = await client.request(
                "POST", "/update_weights_from_disk", json=body, update=True, timeout_s=client.update_timeout_s
            )
            if not isinstance(answer, dict) or not answer.get("success", False):
                raise BackendError(f"SGLang at {client.base_url} did not load {path!r}: {answer!r}")
        finally:
            try:
                await client.request("POST", "/continue_generation", update=True)
            except (TransientBackendError, BackendRejectedError):
                pass
        await self._confirm(version)
        return {}


ROUTES: dict[str, type[ServerRoutes]] = {"asyncvec": _AsyncvecRoutes, "vllm": _VLLMRoutes, "sglang": _SGLangRoutes}


def parse_version(value: Any) -> int | None:
    """A server's weight version as an int (None for vLLM's "default" or SGLang's initial label)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
