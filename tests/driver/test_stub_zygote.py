"""kernel_harness.zygote: a stub subprocess forked from the pre-started interpreter ends as
`subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)` would:
same returncode, stdout and stderr for output, exceptions, exit codes, signals, atexit
handlers, finalizers, threads, environment and argv; past its timeout it is killed with
TimeoutExpired; nothing of pagedkv or CUDA is imported before the script runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernel_harness import zygote

SCRIPTS = {
    "output": "import sys\nprint('out')\nprint('err', file=sys.stderr)",
    "exception": "def f():\n    raise ValueError('boom')\nf()",
    "exit_code": "import sys\nsys.exit(3)",
    "exit_message": "import sys\nsys.exit('bad thing')",
    "signal": "import os, signal\nos.kill(os.getpid(), signal.SIGABRT)",
    "environment": "import os\nprint(os.environ.get('ZYGOTE_CHECK'), os.environ.get('ZYGOTE_UNSET'))",
    "main_module": "import sys\nprint(__name__, '__file__' in globals(), sys.argv, sys.path[0] == '')",
    "atexit_and_finalizer": "import atexit\natexit.register(lambda: print('atexit'))\n"
                            "class A:\n    def __del__(self):\n        print('finalized')\na = A()",
    "thread": "import threading, time\ndef f():\n    time.sleep(0.05)\n    print('thread done')\n"
              "threading.Thread(target=f).start()",
    "fresh_imports": "import sys\nprint(sorted(m for m in sys.modules if m.startswith(('pagedkv', 'cuda', 'torch'))))",
}


@pytest.fixture(scope="module")
def env():
    e = {k: v for k, v in os.environ.items() if k != "ZYGOTE_UNSET"}
    e.pop(zygote.DISABLE_ENV, None)
    return dict(e, ZYGOTE_CHECK="42")


def test_a_forked_child_ends_as_a_fresh_interpreter_does(env):
    for name, script in SCRIPTS.items():
        forked = zygote.run(env, script, 60)
        assert forked is not None, name
        fresh = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), name
        assert forked.args == [sys.executable, "-c", script]
    assert zygote.run(env, SCRIPTS["fresh_imports"], 60).stdout == "[]\n"
    assert zygote.run(env, SCRIPTS["signal"], 60).returncode == -6


def test_past_its_timeout_the_child_is_killed(env):
    with pytest.raises(subprocess.TimeoutExpired) as info:
        zygote.run(env, "import time\nprint('started', flush=True)\ntime.sleep(60)", 0.5)
    assert info.value.timeout == 0.5 and info.value.output == "started\n"
    assert zygote.run(env, "print('next')", 60).stdout == "next\n", "the zygote serves the next child"


def test_it_steps_aside_when_turned_off(env):
    assert zygote.run(dict(env, **{zygote.DISABLE_ENV: "1"}), "pass", 60) is None


def test_a_run_interrupted_between_request_and_reply_leaves_the_next_runs_in_step(env, monkeypatch):
    from multiprocessing.connection import Connection

    real_poll = Connection.poll

    def interrupted(self, timeout=0.0):  # a ^C or a signal-based timeout while the child runs
        monkeypatch.setattr(Connection, "poll", real_poll)
        raise KeyboardInterrupt

    monkeypatch.setattr(Connection, "poll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        zygote.run(env, "import time\ntime.sleep(0.2)\nprint('two')", 60)
    for word in ("three", "four"):  # each reads its own reply, not the interrupted child's exit code
        done = zygote.run(env, f"print('{word}')", 60)
        assert (done.returncode, done.stdout) == (0, f"{word}\n")
