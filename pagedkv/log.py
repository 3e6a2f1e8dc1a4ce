"""The structlog logger every pagedkv module writes its events to."""

import structlog


def get_logger(name: str):
    """A lazy structlog logger with `component=name`; every diagnostic line goes through one.
    It resolves structlog's configuration at each event, so an application configuring
    structlog after importing pagedkv is obeyed."""
    return structlog.get_logger("pagedkv", component=name)
