"""Warm restarts across processes, and crash safety: a child process (forked, so it starts
in milliseconds) fills the tiers and exits, or is killed with SIGKILL; this process then
opens the directory and must serve the same prompts with identical K/V, and never a block
whose bytes differ from what was written (the content of a block is a function of its
tokens, so this process knows what every block must hold)."""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import pytest

from disk_world import DiskWorld, prompt

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs fork (Linux)")


def _child(directory, body, **disk_args) -> int:
    """Fork; the child runs `body(world, ready)` (ready(): tell the parent) and exits 0, or 1
    on an exception. Returns (pid, read end of the ready pipe)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            world = DiskWorld(directory, disk_bytes=24 * 4096, **disk_args)
            body(world, lambda: os.write(write, b"r"))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _wait_ready(fd) -> None:
    assert os.read(fd, 1) == b"r", "the child died before it was ready"
    os.close(fd)


def _fill_and_flush(world, ready):
    for chain in range(1, 7):
        world.fill(f"p{chain}", prompt(chain, 3))
        world.pressure()
    world.disk.flush()
    ready()


def _verify(directory, chains, dropped: list | None = None) -> int:
    """Open the directory in this process and serve every chain: each block served must
    hold its content (DiskWorld.served asserts it). Returns the tokens served from disk
    (and appends to `dropped` how many reads failed their checksum)."""
    world = DiskWorld(directory, disk_bytes=24 * 4096)
    try:
        served = 0
        for chain in chains:
            served += world.served(f"v{chain}", prompt(chain, 3))
            world.table.free(f"v{chain}")
        world.prefix.check_invariants()
        if dropped is not None:
            dropped.append(world.disk.stats().failed_reads)
        return served
    finally:
        world.close()


def test_a_process_that_exits_leaves_a_warm_directory(tmp_path):
    def body(world, ready):
        _fill_and_flush(world, lambda: None)
        world.close()  # a clean shutdown: every queued write finished

    pid, fd = _child(tmp_path, body)
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _verify(tmp_path, range(1, 5)) == 4 * 12  # chains 5 and 6 were on the device and host


def test_a_killed_process_leaves_a_warm_directory(tmp_path):
    def body(world, ready):
        _fill_and_flush(world, ready)
        time.sleep(60)  # killed here

    pid, fd = _child(tmp_path, body)
    _wait_ready(fd)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert _verify(tmp_path, range(1, 5)) == 4 * 12


def test_sigkill_at_random_points_of_heavy_demotion_never_serves_a_wrong_block(tmp_path):
    """50 children, each killed after a random delay while it demotes as fast as it can into
    a 24-slot disk (slots reused all the time, so stale records point at rewritten slots);
    after each kill this process serves every chain the children used from the directory."""
    rng = random.Random(22)
    chains = range(1, 7)
    served_from_disk, dropped = 0, []

    def body(world, ready):
        ready()
        i = 0
        while True:  # heavy demotion until killed
            chain = 1 + (i * 5 + os.getpid()) % len(chains)
            world.fill(f"p{i}", prompt(chain, 3))
            world.pressure()
            i += 1

    for _ in range(50):
        # fsyncs widen the window between bytes and record; 8 staging slots: writes are skipped when behind
        pid, fd = _child(tmp_path, body, durable=True, queue_blocks=8)
        _wait_ready(fd)
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), "the child ended before it was killed"
        served_from_disk += _verify(tmp_path, chains, dropped)
    print(f"served {served_from_disk} tokens from disk; reads dropped per restart: {dropped}")
    assert served_from_disk > 0  # the directory served hits, not only misses
