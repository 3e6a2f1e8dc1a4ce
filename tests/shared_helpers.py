"""Helpers several test modules share (importable as `shared_helpers`: tests/ is on the path)."""

from __future__ import annotations

import threading


def nixl_reason() -> str | None:
    """None when NIXL loads, else why not (the skip reason of the transfer tests)."""
    from pagedkv.tiers.transfer import NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as err:
        return f"NIXL is not installed: {err}"
    return None


def from_other_thread(fn, timeout: float = 30.0):
    """Run `fn()` in a second thread: ("ok", its result) or (exception name, message)."""
    out = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            out.append((type(err).__name__, str(err)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the call did not return"
    return out[0]
