"""OpenAI-compatible serving: a scheduler thread over the batched engine, and a Starlette/uvicorn app.

`register(subparsers)` adds the `serve` subcommand to a CLI; `serve_main(args)` runs the server. The HTTP app
(Starlette, uvicorn) is imported lazily, so `import blockdraft.serve` does not need the web stack.
"""

from .scheduler import LockedTokenizer, QueueFullError, RequestHandle, Scheduler, SchedulerClosedError


def register(subparsers):
    """Add `serve` to an argparse subparsers object (see blockdraft.serve.app.add_serve_args for the flags)."""
    from .app import register as _register

    return _register(subparsers)


def serve_main(args) -> int:
    from .app import serve_main as _serve_main

    return _serve_main(args)


__all__ = ["LockedTokenizer", "QueueFullError", "RequestHandle", "Scheduler", "SchedulerClosedError", "register",
           "serve_main"]
