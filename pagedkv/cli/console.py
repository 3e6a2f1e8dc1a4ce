"""The command line's terminal: a stdout that ends quietly when its reader has gone,
pagedkv's events rendered on stderr, and a progress line on stderr (`Progress`)."""

from __future__ import annotations

import os

import structlog

from ..core.log import LEVELS, STDERR_PROCESSORS, StderrLogger


class QuietClosedPipe:
    """Stands in for a text stream (stdout): once a write or flush meets a closed pipe
    (`pagedkv demo | head -1`), `reader_gone` is set and later output is dropped, so the
    command finishes its cleanup and exits without a BrokenPipeError. The stream's file
    descriptor is pointed at the null device then, so the interpreter's last flush at exit
    has nothing left to fail on."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False
        self.failed: OSError | None = None
        """The first error writing the output (a full disk, `> /dev/full`): the output is
        dropped from then on and the command line reports it on stderr (exit status 1)."""

    def write(self, text: str) -> int:
        """Write `text` unless the reader has gone; returns its length either way."""
        if not self.reader_gone:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._drop_output()
            except OSError as err:
                self.failed = err
                self._drop_output()
        return len(text)

    def flush(self) -> None:
        """Flush unless the reader has gone."""
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop_output()
            except OSError as err:
                self.failed = err
                self._drop_output()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _drop_output(self) -> None:
        self.reader_gone = True
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError, AttributeError):
            return  # not backed by a file descriptor (captured output): nothing left to fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def log_to_stderr(level: str) -> bool:
    """Configure structlog, as an application does, to render every event from `level` up
    on stderr, and return True; an application that configured structlog already keeps its
    configuration (False)."""
    if structlog.is_configured():
        return False
    structlog.configure(
        processors=list(STDERR_PROCESSORS),
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=lambda *args: StderrLogger(),
        cache_logger_on_first_use=False,
    )
    return True


class Progress:
    """A progress line on `stream` (stderr), never on stdout. On a terminal (`in_place`) it is
    one line rewritten in place (carriage return, erase to the end of the line) and
    `clear()` erases it before a result line goes out on stdout; elsewhere (`--progress`
    into a file or pipe) each update is a line of its own and `clear()` does nothing."""

    ERASE = "\r\x1b[K"

    def __init__(self, stream, in_place: bool, command: str):
        self._stream, self._in_place, self._command = stream, in_place, command
        self._shown = False

    def __call__(self, what: str, step: int, steps: int, done: int, total: int) -> None:
        """Show `what` (pass `step` of `steps`): `done` of `total` tokens."""
        text = f"pagedkv {self._command}: {what} ({step}/{steps}): {done:,}/{total:,} tokens"
        if self._in_place:
            self._stream.write(self.ERASE + text)
            self._shown = True
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def clear(self) -> None:
        """Erase the line on a terminal (before stdout is written, and at the end)."""
        if self._in_place and self._shown:
            self._stream.write(self.ERASE)
            self._stream.flush()
            self._shown = False
