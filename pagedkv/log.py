"""The structlog logger every pagedkv module writes its events to."""

import structlog


def get_logger(name: str):
    """A structlog logger with `component=name`; every diagnostic line goes through one.

    It is a lazy proxy resolved when it logs, so an application that calls
    `structlog.configure()` after importing pagedkv still gets pagedkv's events."""
    return structlog.get_logger("pagedkv", component=name)
