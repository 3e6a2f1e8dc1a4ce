"""Exceptions raised by pagedkv."""


class PagedKvError(Exception):
    """Base class of every pagedkv error."""


class KvCacheError(Exception):
    """Base class of the KV cache's own errors."""


class KvCacheExhausted(KvCacheError):
    """No free block (or not enough free blocks) to satisfy an allocation; nothing was taken."""


class RefCountError(KvCacheError):
    """A reference-count bug: a decrement at zero or an increment of a free block."""


class DeviceMemoryError(RuntimeError):
    """A backend memory operation was refused: unknown pointer, range past its allocation, double free."""


class DeviceOutOfMemory(DeviceMemoryError, MemoryError):
    """An allocation larger than the backend's free memory."""


class TeardownError(RuntimeError):
    """One or more resources failed to release; the message lists each label and its error."""

    def __init__(self, failures: list[tuple[str, BaseException]]):
        self.failures = failures
        detail = "; ".join(f"{label}: {err}" for label, err in failures)
        super().__init__(f"{len(failures)} resource(s) failed to release: {detail}")
