"""The ``asyncvec`` console script.

Example:
    $ asyncvec demo           # PPO async vs sync with stragglers, the ratio against its bound (about 5 minutes)
    $ asyncvec demo-llm       # a tiny language model learns single-digit sums with RLOO and REINFORCE++
    $ asyncvec serve --model ./tiny-lm --port 8000 --weights-dir ./checkpoints &
    $ asyncvec wait-ready http://127.0.0.1:8000 --timeout 120
    $ asyncvec free-port      # prints a free TCP port
    $ asyncvec docs           # the docs' pages; asyncvec docs agents prints docs/agents.md, --path its file
    $ asyncvec --version      # also: python -m asyncvec
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncvec.lifecycle import interrupts_outside_locks

TOKEN_ENV = "ASYNCVEC_SERVE_TOKEN"
DEMOS = {
    "demo": "PPO on CartPole-v1, async vs sync with stragglers: env-steps/s, time to a return of 475, and the "
    "ratio against the bound the measured stage times allow (about 5 minutes on 2 cores; what `make demo` runs; "
    "needs the plots extra); its tables and plots go to ./asyncvec-results (--out-dir), it prints where",
    "demo-llm": "a tiny language model (built from a config, no download) learns single-digit sums with RLOO and "
    "REINFORCE++ after a short supervised warm start (about 2 minutes on 2 cores; needs the hf extra)",
}


def docs_dir() -> Path:
    """The folder of asyncvec's docs (the repository's docs/*.md): ``asyncvec/docs`` in an installed wheel (setup.py
    ships them as package data), ``docs/`` beside the package in a clone or an unpacked sdist (an editable install)."""
    package = Path(__file__).resolve().parent
    if (package / "docs" / "agents.md").is_file():
        return package / "docs"
    if (package.parent / "setup.py").is_file() and (package.parent / "docs" / "agents.md").is_file():
        return package.parent / "docs"
    raise FileNotFoundError(f"asyncvec's docs are not installed beside {package}: reinstall asyncvec")


def doc_names() -> list[str]:
    """The pages of the docs, by name: ``agents`` is docs/agents.md (``asyncvec docs agents``)."""
    return sorted(path.stem for path in docs_dir().glob("*.md"))


def doc_path(name: str) -> Path:
    """The file of one page of the docs. ``agents``, ``agents.md``, ``docs/agents.md`` and
    ``docs/agents.md#running-an-agent`` (a pointer as the docstrings and messages write it) all name docs/agents.md.

    Example:
        >>> doc_path("docs/agents.md#running-an-agent").name
        'agents.md'
        >>> doc_path("lm-agents") == doc_path("lm_agents.md")
        True
    """
    stem = Path(name.partition("#")[0].strip()).name.removesuffix(".md").replace("-", "_")
    path = docs_dir() / f"{stem}.md"
    if not stem or not path.is_file():
        raise LookupError(f"no page {name!r} in the docs; the pages: {', '.join(doc_names())}")
    return path


def _show_docs(page: str | None, path_only: bool) -> int:
    """``asyncvec docs``: the list of pages, one page's Markdown, or (--path) where its file is."""
    try:
        if page is None:
            folder = docs_dir()
            if path_only:
                print(folder)
                return 0
            print(f"asyncvec's docs, in {folder} (asyncvec docs NAME prints a page, --path its file):")
            for name in doc_names():
                title = (folder / f"{name}.md").read_text(encoding="utf-8").partition("\n")[0].lstrip("# ")
                print(f"  {name:<14} {title}")
            return 0
        path = doc_path(page)
    except LookupError as exc:  # a page that does not exist: the ones that do
        print(f"asyncvec docs: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"asyncvec docs: {exc}", file=sys.stderr)
        return 1
    try:
        print(path if path_only else path.read_text(encoding="utf-8"), flush=True)
    except BrokenPipeError:  # asyncvec docs agents | head: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def _existing_dir(value: str) -> Path:
    path = Path(value)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is not a directory")
    return path


def _checked_number(
    convert: Callable[[str], float], accepts: Callable[[float], bool], kind: str, bound: str
) -> Callable[[str], Any]:
    """An argparse type: ``convert(value)`` when it ``accepts`` the number; else an error saying the ``kind`` of
    number expected, or the ``bound`` it missed."""

    def parse(value: str) -> Any:
        try:
            number = convert(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind}, got {value!r}") from None
        if not accepts(number):
            raise argparse.ArgumentTypeError(f"{bound}, got {value}")
        return number

    return parse


_port = _checked_number(
    int, lambda port: 0 <= port < 65536, "port must be an int", "port must be in 0..65535 (0: any free port)"
)
_positive_int = _checked_number(int, lambda number: number >= 1, "expected an int", "expected an int >= 1")
_non_negative_float = _checked_number(float, lambda number: number >= 0, "expected a number", "expected a number >= 0")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``asyncvec`` command."""
    from asyncvec import __version__

    parser = argparse.ArgumentParser(prog="asyncvec", description="asyncvec command line tools")
    parser.add_argument("--version", action="version", version=f"asyncvec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, what in DEMOS.items():  # listed here; main() hands their options to the demo's own parser
        commands.add_parser(name, help=what, description=what)
    serve = commands.add_parser(
        "serve",
        help="serve a transformers model folder over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible /v1/completions server (with log-probs and weight updates) for a model folder.",
    )
    serve.add_argument("--model", required=True, type=_existing_dir, help="save_pretrained folder (model + tokenizer)")
    serve.add_argument("--port", required=True, type=_port, help="TCP port (0: any free one, printed at start)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    serve.add_argument(
        "--weights-dir",
        type=_existing_dir,
        default=None,
        help="POST /update_weights loads only from inside this folder (omit: updates disabled)",
    )
    serve.add_argument(
        "--token",
        default=None,
        help=f"bearer token required by /update_weights (or set ${TOKEN_ENV}; prefer the variable: it stays out of ps)",
    )
    serve.add_argument("--model-name", default=None, help="name clients send as 'model' (default: the folder name)")
    serve.add_argument("--max-batch-size", type=_positive_int, default=32, help="largest batch sent to the model")
    serve.add_argument("--max-wait-ms", type=_non_negative_float, default=5.0, help="longest wait for a batch to fill")
    serve.add_argument(
        "--max-tokens-limit", type=_positive_int, default=256, help="largest max_tokens a request may ask for"
    )
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    wait = commands.add_parser(
        "wait-ready",
        help="wait until a server's health route answers 200 (exit 0), or fail after --timeout (exit 1)",
        description="Poll URL/health until it answers 200: for scripts that start a server in the background.",
    )
    wait.add_argument("url", help="server root, e.g. http://127.0.0.1:8000")
    wait.add_argument("--timeout", type=_non_negative_float, default=300.0, help="seconds to wait (default 300)")
    wait.add_argument("--health-path", default="/health", help="route to poll (default /health)")
    commands.add_parser("free-port", help="print a TCP port that is free on 127.0.0.1")
    docs = commands.add_parser(
        "docs",
        help="the docs that ship with asyncvec: list the pages, print one (asyncvec docs agents), or its file (--path)",
        description="The docs (docs/*.md in the source) ship with asyncvec: without NAME, the pages and their folder; "
        "with NAME, that page's Markdown (a pointer such as 'docs/agents.md' or 'asyncvec docs agents' names it).",
    )
    docs.add_argument("page", nargs="?", metavar="NAME", help="agents, lm_agents, inference, ... (also docs/agents.md)")
    docs.add_argument("--path", action="store_true", help="print the page's file (or the docs' folder), not its text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncvec`` console script (and ``python -m asyncvec``): 0 on success, 1 on a reported
    error, 2 on one the user can fix (a wrong argument, a missing extra: one line naming the fix), 130 when stopped
    with Ctrl-C (one line, no traceback; never delivered while a lock is half taken: `interrupts_outside_locks`)."""
    with interrupts_outside_locks():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    if argv and argv[0] in DEMOS:
        try:
            return _demo(argv[0], argv[1:])
        except KeyboardInterrupt:
            print(f"asyncvec {argv[0]}: stopped (Ctrl-C)", file=sys.stderr)
            return 130
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"asyncvec {args.command}: stopped (Ctrl-C)", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command == "docs":
        return _show_docs(args.page, args.path)
    if args.command == "free-port":
        from asyncvec.inference.serving.server_process import free_port

        print(free_port())
        return 0
    if args.command == "wait-ready":
        from asyncvec.extras import check_installed
        from asyncvec.inference.serving.server_process import ServerStartError, wait_until_ready

        try:
            check_installed("httpx", extra="serve", feature="asyncvec wait-ready")
        except ImportError as exc:  # a missing extra: the message names the install command
            print(f"asyncvec wait-ready: {exc}", file=sys.stderr)
            return 2
        try:
            waited = wait_until_ready(args.url, timeout_s=args.timeout, health_path=args.health_path)
        except ServerStartError as exc:
            print(f"asyncvec wait-ready: {exc}", file=sys.stderr)
            return 1
        print(f"asyncvec wait-ready: {args.url} is ready after {waited:.1f} s", file=sys.stderr)
        return 0
    if args.command == "serve":
        try:
            from asyncvec.inference.serving.server import bind_socket, serve
        except ImportError as exc:  # a missing extra: the message names the install command
            print(f"asyncvec serve: {exc}", file=sys.stderr)
            return 2

        token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"asyncvec serve: binding {args.host}: the server is reachable from the network", file=sys.stderr)
            if token is None and args.weights_dir is not None:
                print("asyncvec serve: /update_weights has no token; pass --token or set " + TOKEN_ENV, file=sys.stderr)
        try:  # bind before loading the model: a port in use is reported at once
            sock = bind_socket(args.host, args.port)
        except OSError as exc:
            print(f"asyncvec serve: {exc}", file=sys.stderr)
            return 1
        port = sock.getsockname()[1]
        print(
            f"asyncvec serve: {args.model} on http://{args.host}:{port} (loading the model)",
            file=sys.stderr,
            flush=True,
        )
        serve(
            args.model,
            host=args.host,
            port=port,
            weights_dir=args.weights_dir,
            token=token,
            model_name=args.model_name,
            max_batch_size=args.max_batch_size,
            max_wait_ms=args.max_wait_ms,
            max_tokens_limit=args.max_tokens_limit,
            log_level=args.log_level,
            sock=sock,
        )
    return 0


def _demo(name: str, options: Sequence[str]) -> int:
    """Runs a demo of the installed package (asyncvec.benchmarks) with its own options; ``asyncvec demo``'s tables
    and plots go to --out-dir, by default ./asyncvec-results (benchmarks/results in a clone): it prints where."""
    import tyro

    from asyncvec.extras import MissingExtraError, check_installed

    try:
        if name == "demo":
            from asyncvec.benchmarks import ppo_speed
            from asyncvec.benchmarks.report import RESULTS_DIR

            args = tyro.cli(ppo_speed.Args, args=options, prog=f"asyncvec {name}")
            check_installed("matplotlib", extra="plots", feature="asyncvec demo (its plots)")
            out_dir = Path(args.out_dir if args.out_dir is not None else RESULTS_DIR).resolve()
            print(f"asyncvec demo: the tables and plots go to {out_dir}", flush=True)
            ppo_speed.main(args)
            return 0
        from asyncvec.benchmarks import demo_llm

        demo_args = tyro.cli(demo_llm.DemoArgs, args=options, prog=f"asyncvec {name}")
        check_installed("transformers", extra="hf", feature="asyncvec demo-llm")
        results = demo_llm.main(demo_args)
    except MissingExtraError as exc:
        print(f"asyncvec {name}: {exc}", file=sys.stderr)
        return 2
    return 0 if all(result.reached_target for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
