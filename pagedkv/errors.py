"""Exceptions raised by pagedkv: every one derives from `PagedKvError`."""


class PagedKvError(Exception):
    """Base class of every error pagedkv raises on its own account (catch this to catch them all).

    Argument checks still raise the built-in TypeError, ValueError and IndexError."""


class KvCacheError(PagedKvError):
    """Base class of the KV cache's own errors."""


class KvCacheExhausted(KvCacheError):
    """No free block (or not enough free blocks) to satisfy an allocation; nothing was taken."""


class RefCountError(KvCacheError):
    """A reference-count bug: a decrement at zero, an increment of a free block, or a
    decrement that would free a block the prefix cache still holds."""


class DeviceMemoryError(PagedKvError, RuntimeError):
    """A backend memory operation was refused: unknown pointer, range past its allocation, double free."""


class DeviceOutOfMemory(DeviceMemoryError, MemoryError):
    """An allocation larger than the backend's free memory."""


class ChunkNotMapped(DeviceMemoryError):
    """`unmap_chunk` of a range with no chunk mapped there (never mapped, or unmapped
    already: a retry after an unmap that failed late finds it gone)."""


class TeardownError(PagedKvError, RuntimeError):
    """One or more resources failed to release; the message lists each label and its error."""

    def __init__(self, failures: list[tuple[str, BaseException]]):
        self.failures = failures
        detail = "; ".join(f"{label}: {err}" for label, err in failures)
        super().__init__(f"{len(failures)} resource(s) failed to release: {detail}")
