"""Where the app's own log lines go: the process's stderr, which Ray keeps per worker
(`worker-*.err` under the session's logs, `ray logs`) and forwards to the driver.

Under Serve's throughput-optimized mode (the tests' and Kubernetes' default) a replica's stderr is
routed into Serve's request-path logger at INFO, behind a buffer of 1,000 records that flushes on
ERROR only: the app's warnings (refused admin calls, failed swaps) reached no file at all."""

from __future__ import annotations

import logging
import sys

APP_LOGGERS = ("app", "workers", "policies")


def send_app_logs_to_stderr(level: int = logging.INFO) -> None:
    """Give the app's loggers a handler of their own on the process's real stderr (once per process)."""
    if any(isinstance(h, _AppHandler) for h in logging.getLogger(APP_LOGGERS[0]).handlers):
        return
    handler = _AppHandler(sys.__stderr__)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in APP_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


class _AppHandler(logging.StreamHandler):
    """The handler `send_app_logs_to_stderr` adds, told apart from any other."""
