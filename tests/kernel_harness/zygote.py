"""Run a `python -c SCRIPT` child forked from a pre-started interpreter that has already
imported numpy and ml_dtypes, for the stub subprocesses (stub.run_on_stub).

Importing ml_dtypes costs ~0.5 s of CPU (numpy 2.4 registers its ufunc loops one linear
search at a time) and the suite starts a few hundred stub subprocesses; a fork of an
interpreter that paid it once costs milliseconds. Nothing of pagedkv, cuda.bindings or
libcuda is loaded before the fork, so each child still imports pagedkv and loads the stub
itself, as a fresh interpreter would.

`run(env, script, timeout)` returns a `subprocess.CompletedProcess` as
`subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
timeout=timeout)` would: the child gets `env` as its environment, stdin from /dev/null,
stdout and stderr captured; an uncaught exception prints its traceback and exits 1,
`SystemExit` exits with its code, a signal gives a negative returncode, and past `timeout`
the child is killed and `subprocess.TimeoutExpired` raised. At the end of the script the
child runs its atexit handlers, clears the script's globals and collects garbage (what an
interpreter's shutdown does with `__main__`), then exits.

It is used only where the variables the interpreter reads at start (PYTHON*, LD_*, the
BLAS and OpenMP thread counts, numpy's) are those of a zygote started for them (one per
set, started on first use; it exits when this process does); `run` returns None
otherwise, and the caller starts an ordinary subprocess. PAGEDKV_TEST_NO_ZYGOTE=1 turns
it off.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection

DISABLE_ENV = "PAGEDKV_TEST_NO_ZYGOTE"
"""Environment variable: set to 1, every stub subprocess is an ordinary one."""

_STARTUP_PREFIXES = ("PYTHON", "LD_", "OPENBLAS", "OMP_", "MKL_", "GOTO", "NUMPY", "NPY_")

_SERVER = r'''
import os, sys, traceback, gc, types, atexit, signal
from multiprocessing.connection import Connection
import ctypes, struct, threading
import numpy, ml_dtypes  # the costly imports every child shares
conn = Connection(int(sys.argv[1]))

def child(env, script, out_path, err_path):
    conn.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["-c"]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(script, "<string>", "exec"), main.__dict__)
        threading._shutdown()  # an interpreter's exit waits for its non-daemon threads
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as err:
        # as an interpreter prints it: from the script's frame on, not this function's
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        code = 1
    try:
        atexit._run_exitfuncs()
        main.__dict__.clear()
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    os._exit(code & 0xFF)

while True:
    try:
        env, script, out_path, err_path = conn.recv()
    except EOFError:
        break
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child(env, script, out_path, err_path)
        finally:
            os._exit(70)
    conn.send(pid)
    _, status = os.waitpid(pid, 0)
    conn.send(os.waitstatus_to_exitcode(status))
'''

_zygotes: dict[tuple, tuple[subprocess.Popen, Connection]] = {}
_busy = threading.Lock()  # one child at a time; a concurrent caller gets an ordinary subprocess


def _startup_key(env: dict) -> tuple:
    return (os.getcwd(), tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP_PREFIXES))))


def _zygote(env: dict) -> Connection | None:
    key = _startup_key(env)
    entry = _zygotes.get(key)
    if entry is not None and entry[0].poll() is None:
        return entry[1]
    import socket

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(theirs.fileno())], env=env,
                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    theirs.close()
    conn = Connection(ours.detach())
    _zygotes[key] = (proc, conn)
    return conn


@atexit.register
def _close_all() -> None:
    for proc, conn in _zygotes.values():
        conn.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    _zygotes.clear()


def run(env: dict, script: str, timeout: float) -> subprocess.CompletedProcess | None:
    """`python -c script` in `env`, forked from a zygote (see the module docstring); None
    where no zygote can serve `env` (the caller runs an ordinary subprocess)."""
    if os.environ.get(DISABLE_ENV) == "1" or env.get(DISABLE_ENV) == "1" or not hasattr(os, "fork"):
        return None
    if not _busy.acquire(blocking=False):
        return None
    try:
        return _run(env, script, timeout)
    finally:
        _busy.release()


def _drop(key) -> None:
    """Forget the zygote of `key` and end it (its replies may no longer match our requests)."""
    entry = _zygotes.pop(key, None)
    if entry is None:
        return
    proc, conn = entry
    conn.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _run(env: dict, script: str, timeout: float) -> subprocess.CompletedProcess | None:
    conn = _zygote(env)
    key = _startup_key(env)
    args = [sys.executable, "-c", script]
    with tempfile.TemporaryDirectory(prefix="pkv-zygote-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        try:
            conn.send((dict(env), script, out_path, err_path))
            pid = conn.recv()
        except (EOFError, OSError):  # the zygote died: forget it, run an ordinary subprocess
            _drop(key)
            return None
        except BaseException:  # interrupted between request and reply: the replies would be out of step
            _drop(key)
            raise
        try:
            deadline = time.monotonic() + timeout
            timed_out = not conn.poll(max(0.0, deadline - time.monotonic()))
            if timed_out:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            returncode = conn.recv()
        except BaseException:  # (the child's exit code would be read as the next run's pid)
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            _drop(key)
            raise
        with open(out_path, encoding="utf-8", errors="replace") as f:
            stdout = f.read()
        with open(err_path, encoding="utf-8", errors="replace") as f:
            stderr = f.read()
    if timed_out:
        raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, returncode, stdout, stderr)
