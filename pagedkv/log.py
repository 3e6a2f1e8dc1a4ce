"""The structlog logger every pagedkv module writes its events to."""

import structlog


def get_logger(name: str):
    """A structlog logger bound to `component=name`; every diagnostic line goes through one."""
    return structlog.get_logger("pagedkv").bind(component=name)
