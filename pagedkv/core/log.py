"""Where pagedkv's structlog events go.

Every pagedkv module writes structlog events with fields through `get_logger(name)`. Where
they end up is decided at each event:

- An application that configured structlog (`structlog.configure(...)`, before or after
  importing pagedkv) gets every pagedkv event through its own configuration, debug
  included, as a logger named "pagedkv" bound with `component=name`; its processors and
  level filter decide what is kept.
- Otherwise pagedkv prints nothing the application did not ask for: warnings and errors
  go to stderr as one rendered line each, info and debug are dropped, until
  `pagedkv.log.enable("debug")` (or "info") lowers that threshold.

Nothing pagedkv logs ever goes to stdout on its own.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
"""The level names `enable` accepts, lowest first."""

_DEFAULT_LEVEL = logging.WARNING


class StderrLogger:
    """A structlog logger (the last step of a chain) that writes each rendered event as one
    line to whatever `sys.stderr` is when the event happens (so a replaced stderr is obeyed)."""

    _lock = threading.Lock()

    def msg(self, message: str) -> None:
        """Write `message` and a newline to stderr, flushed."""
        with self._lock:
            stream = sys.stderr
            if stream is None:
                return
            stream.write(message + "\n")
            stream.flush()

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


STDERR_PROCESSORS = (
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S"),
    structlog.processors.StackInfoRenderer(),
    structlog.processors.format_exc_info,
    structlog.dev.ConsoleRenderer(colors=False),
)
"""The processors of pagedkv's stderr output: level, time, exception, one plain-text line."""

_state = {"level": _DEFAULT_LEVEL, "loggers": {}}


def enable(level: str = "debug") -> None:
    """Print pagedkv's events from `level` up ("debug", "info", "warning" or "error") to
    stderr, when the application has not configured structlog itself (then its own
    configuration decides and this has no effect). "warning" is the default threshold.
    ValueError names an unknown level."""
    if not isinstance(level, str) or level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    _state["level"] = LEVELS[level.lower()]
    _state["loggers"] = {}


def _own_logger(name: str):
    loggers = _state["loggers"]
    logger = loggers.get(name)
    if logger is None:
        wrapper = structlog.make_filtering_bound_logger(_state["level"])
        logger = wrapper(StderrLogger(), list(STDERR_PROCESSORS), {"component": name})
        loggers[name] = logger
    return logger


def debug_enabled() -> bool:
    """Whether a debug event could be kept now: pagedkv's own threshold when the
    application has not configured structlog, else its wrapper class's level when that is
    a filtering logger (`make_filtering_bound_logger`), else True. Hot paths ask this
    before building a debug event's fields."""
    if not structlog.is_configured():
        return _state["level"] <= logging.DEBUG
    wrapper = structlog.get_config().get("wrapper_class")
    enabled = getattr(wrapper, "is_enabled_for", None)
    if enabled is None:
        return True
    try:
        return bool(enabled(None, logging.DEBUG))  # (the filtering classes ignore `self`)
    except Exception:  # noqa: BLE001 - another wrapper: keep the event
        return True


class PagedKvLogger:
    """A pagedkv module's logger: `debug/info/warning/error/exception/critical(event, **fields)`
    send one structlog event, routed as the module docstring says."""

    __slots__ = ("_name", "_application")

    def __init__(self, name: str):
        self._name = name
        # structlog's lazy proxy resolves the configuration at each event, so it follows an
        # application that configures structlog after this logger was made.
        self._application = structlog.get_logger("pagedkv", component=name)

    def _target(self):
        if structlog.is_configured():
            return self._application
        return _own_logger(self._name)

    def debug(self, event: str, **fields: Any) -> None:
        """A debug event (hidden unless enabled or the application's configuration keeps it)."""
        self._target().debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        """An info event (hidden unless enabled or the application's configuration keeps it)."""
        self._target().info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        """A warning event (stderr by default)."""
        self._target().warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        """An error event (stderr by default)."""
        self._target().error(event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error event with the exception being handled (stderr by default)."""
        self._target().exception(event, **fields)

    def critical(self, event: str, **fields: Any) -> None:
        """A critical event (stderr by default)."""
        self._target().critical(event, **fields)


def get_logger(name: str) -> PagedKvLogger:
    """The logger for pagedkv module `name`: its events carry `component=name` and follow the
    application's structlog configuration when there is one, else stderr from warning up."""
    return PagedKvLogger(name)
