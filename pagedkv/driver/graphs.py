"""CUDA graph capture on CudaBackend: `gpu.capture(stream)` records the stream-ordered work
enqueued on one of the backend's streams into a graph that `launch(stream)` replays.

What a graph records is the kernels, async copies and memsets enqueued on the capturing
stream, with their arguments as they were at capture: the same device addresses on every
replay, so an engine step replays with new contents written into the same buffers (new K/V
rows, new slots in the same slot buffer). pagedkv's device path (`write_tokens` /
`read_tokens` with device arrays) is one launch per call and can be captured; a host-staged
call cannot (it synchronises and copies through the host), and the driver refuses it.
"""

from __future__ import annotations

from typing import Any

from ..core.log import get_logger
from ._bindings import driver as _driver
from .errors import CudaError, check

_log = get_logger("cuda")

CAPTURE_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}
"""cuStreamBeginCapture modes by name (CU_STREAM_CAPTURE_MODE_*)."""

CAPTURE_STATUSES = frozenset({900, 901, 906})
"""Driver statuses of a call a capture cannot record: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
_INVALIDATED and _IMPLICIT (the legacy default stream while a blocking stream captures)."""

CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901


class GraphCaptureError(CudaError):
    """A call inside `CudaBackend.capture` could not be captured (a host synchronisation, an
    allocation or free, a synchronous or host-staged copy, work on the legacy default stream,
    or any call after one of those): the driver invalidated the capture and nothing of it is
    kept. `call`, `status` and `status_name` are the refused call's (as in CudaError)."""


class CudaGraph:
    """A captured, instantiated CUDA graph of one CudaBackend. `launch(stream)` enqueues a
    replay on one of the backend's streams (stream-ordered like any other work, so it may
    itself be captured); `close()` frees the graph (a second call does nothing; a graph
    still open when the backend closes is freed then). Before its capture ends, and after
    `close()`, `launch` raises RuntimeError."""

    def __init__(self, backend: Any):
        self._backend = backend
        self._graph = None
        self._exec = None
        self._closed = False

    @property
    def ready(self) -> bool:
        """True between the end of a successful capture and `close()`."""
        return self._exec is not None and not self._closed

    def launch(self, stream: int) -> None:
        """Enqueue one replay of the captured work on `stream` (`cuGraphLaunch`)."""
        if not self.ready:
            raise RuntimeError("this CudaGraph is closed" if self._closed else "this CudaGraph's capture has not ended")
        handle = self._backend._stream(stream)
        with self._backend._lock:
            driver = self._backend._enter()
            check(driver.cuGraphLaunch(self._exec, handle), "cuGraphLaunch")

    def close(self) -> None:
        """`cuGraphExecDestroy` and `cuGraphDestroy` (both attempted; the first error raised).
        A handle the driver refuses to destroy stays recorded: a second `close()`, or the
        backend's close, tries it again; with nothing left a call does nothing."""
        with self._backend._lock:
            self._closed = True
            first = None
            if self._exec is not None or self._graph is not None:
                driver = self._backend._enter()
                for call, attr in (("cuGraphExecDestroy", "_exec"), ("cuGraphDestroy", "_graph")):
                    handle = getattr(self, attr)
                    if handle is None:
                        continue
                    try:
                        check(getattr(driver, call)(handle), call)
                    except CudaError as err:
                        first = first or err
                    else:
                        setattr(self, attr, None)
            if first is not None:
                raise first
            self._backend._graphs.discard(self)


class _Capture:
    """The context manager `CudaBackend.capture` returns."""

    def __init__(self, backend: Any, stream: int, mode: str):
        if mode not in CAPTURE_MODES:
            raise ValueError(f"capture mode must be one of {', '.join(CAPTURE_MODES)}, got {mode!r}")
        if stream == 0:
            raise ValueError("the legacy default stream cannot be captured: pass a stream from create_stream()")
        self._backend = backend
        self._handle = backend._stream(stream)
        self._mode = CAPTURE_MODES[mode]
        self._graph = CudaGraph(backend)

    def __enter__(self) -> CudaGraph:
        with self._backend._lock:
            driver = self._backend._enter()
            check(driver.cuStreamBeginCapture(self._handle, _driver.CUstreamCaptureMode(self._mode)), "cuStreamBeginCapture")
        return self._graph

    def __exit__(self, kind, error, traceback) -> None:
        with self._backend._lock:
            driver = self._backend._enter()
            status, graph = driver.cuStreamEndCapture(self._handle)
            code = int(getattr(status, "value", status))
            if error is not None:
                if code == 0 and graph is not None:
                    destroyed = driver.cuGraphDestroy(graph)
                    if int(getattr(destroyed[0], "value", destroyed[0])) != 0:
                        _log.error("cuda_graph_destroy_failed", status=int(getattr(destroyed[0], "value", destroyed[0])))
                        self._graph._graph, self._graph._closed = graph, True  # recorded: close() retries it
                        self._backend._graphs.add(self._graph)
                if isinstance(error, CudaError) and not isinstance(error, GraphCaptureError) and error.status in CAPTURE_STATUSES:
                    raise _capture_error(error) from error
                return  # the body's own exception goes on
            if code == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
                raise GraphCaptureError(
                    "cuStreamEndCapture", code, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
                    "a call inside the capture could not be captured (its error was caught inside the block)",
                    "and invalidated it: nothing was captured")
            check((status,), "cuStreamEndCapture")
            try:
                exec_ = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            except BaseException:
                driver.cuGraphDestroy(graph)
                raise
            self._graph._graph, self._graph._exec = graph, exec_
            self._backend._graphs.add(self._graph)


def _capture_error(err: CudaError) -> GraphCaptureError:
    return GraphCaptureError(
        err.call, err.status, err.status_name, err.driver_message,
        "inside a CUDA graph capture: only stream-ordered work on the capturing stream can be "
        "captured (on CudaBackend, write_tokens/read_tokens with device arrays and out_k/out_v); "
        "host arrays, allocations, host synchronisation and the legacy default stream cannot. "
        "The capture was discarded",
    )


class GraphCapture:
    """The CUDA graph half of CudaBackend (a mixin: CudaBackend provides `_enter`, `_lock`
    and `_stream`)."""

    @property
    def _graphs(self) -> set:
        graphs = self.__dict__.get("_graph_set")
        if graphs is None:
            graphs = self.__dict__["_graph_set"] = set()
        return graphs

    def capture(self, stream: int, mode: str = "global") -> _Capture:
        """A context manager capturing the work enqueued on `stream` (one of this backend's
        streams from `create_stream`; ValueError for the default stream or an unknown one)
        into the CudaGraph it yields: nothing enqueued on `stream` inside the block runs
        then; after the block the graph is instantiated and `graph.launch(stream)` replays
        it. `mode` is the driver's capture mode: "global" (default: potentially unsafe
        calls such as allocations and synchronous copies are refused in every thread while
        this capture runs), "thread_local" (in this thread) or "relaxed". A call the driver
        refuses during capture raises GraphCaptureError (a CudaError) out of the block, the
        capture discarded; any other exception from the block ends the capture, discards
        it and goes on unchanged."""
        return _Capture(self, stream, mode)

    def _close_graphs(self, attempt) -> None:
        """close(): free every graph still open, each through `attempt`."""
        for graph in list(self._graphs):
            attempt(graph.close)
