"""The fault-injection sweep: every watched backend call of the elastic, host-tier and
tier+elastic scenarios (tests/fault_injection.py) fails once, before taking effect, and
(for the calls a caller can survive that way: unmaps, maps, waits, copies) after it; then,
with faults off, the invariants hold, every block handed out is mapped, and releasing
everything (the retry of what failed) leaves nothing live on the backend. Seeded by
construction (every position, in order); well under a second per scenario.

The same sweep over CudaBackend on the libcuda stub is tests/driver/test_fault_sweep_stub.py."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from fault_injection import LATE, SCENARIOS, count_calls, run_scenario


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_failing_backend_call_is_survived_with_nothing_leaked(name):
    calls = count_calls(name)
    assert len(calls) >= 30, calls
    problems, runs = [], 0
    with capture_logs():
        for late in (False, True):
            for at, method in enumerate(calls):
                if late and method not in LATE:
                    continue
                runs += 1
                try:
                    fired, _, live = run_scenario(name, at, late)
                except Exception as err:  # noqa: BLE001 - recorded with its position
                    problems.append((at, method, late, f"{type(err).__name__}: {err}"))
                    continue
                assert fired == method, (at, method, fired)
                if any(live.values()):
                    problems.append((at, method, late, live))
    assert problems == []
    assert runs > len(calls)  # some late positions ran too
