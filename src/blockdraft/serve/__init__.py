"""OpenAI-compatible serving: a scheduler thread over the batched engine (scheduler.py), request validation
(schema.py), metrics (metrics.py), the server's typed config (config.py) and a Starlette/uvicorn app (app.py,
imported only to run a server, so `import blockdraft.serve` does not need the web stack). `blockdraft serve`
(cli/serve.py) runs it."""

from .config import ServeConfig
from .scheduler import LockedTokenizer, QueueFullError, RequestHandle, Scheduler, SchedulerClosedError

__all__ = ["LockedTokenizer", "QueueFullError", "RequestHandle", "Scheduler", "SchedulerClosedError", "ServeConfig"]
