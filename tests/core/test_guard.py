"""ThreadGuard: re-entry by the thread inside, refusal of any other, free again after the last exit."""

from __future__ import annotations

import threading

import pytest

from pagedkv.core.guard import ConcurrentUseError, ThreadGuard


def other_thread_enters(guard: ThreadGuard) -> list[str]:
    outcome: list[str] = []

    def attempt():
        try:
            guard.enter()
        except ConcurrentUseError as err:
            outcome.append(str(err))
        else:
            outcome.append("entered")
            guard.exit()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(30)
    return outcome


def test_the_thread_inside_re_enters_and_others_are_refused_until_the_last_exit():
    guard = ThreadGuard("this test's cache")
    guard.enter()
    guard.enter()
    assert (guard.depth, guard.owner, guard.inside()) == (2, threading.get_ident(), True)
    refused = other_thread_enters(guard)
    assert refused == [
        "this test's cache is in use by another thread: use it (and its PrefixCache and SequenceTables) "
        "from one thread at a time, or serialise the calls with a lock"
    ]
    assert (guard.depth, guard.owner) == (2, threading.get_ident())
    guard.exit()
    assert other_thread_enters(guard)[0].startswith("this test's cache is in use")
    guard.exit()
    assert (guard.depth, guard.owner, guard.inside(), guard.token) == (0, None, False, [True])
    assert other_thread_enters(guard) == ["entered"]
    assert (guard.depth, guard.owner, guard.token) == (0, None, [True])


def test_a_claimed_token_without_an_owner_yet_refuses_the_next_thread():
    guard = ThreadGuard("g")
    guard.token.pop()  # another thread won the claim and has not recorded itself yet
    with pytest.raises(ConcurrentUseError, match="g is in use by another thread"):
        guard.enter()
    assert (guard.depth, guard.owner, guard.token) == (0, None, [])
