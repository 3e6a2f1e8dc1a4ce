"""Speculative decoding bookkeeping: a serving mix with drafting (lookahead 4, 30% of the
drafts rejected) beside the same mix without drafting, through SequenceTable.

64 sequences, each with a 512-token prompt (a shared 256-token system prompt, then its own),
are stepped together; each step every sequence appends its tokens and the batch's slot
mapping is exported (what an engine does per step). Without drafting a step commits one
token per sequence (`append(seq, 1, [id])`). With drafting a step commits the previous
step's accepted drafts plus one token and takes 4 draft slots
(`append(seq, 1 + accepted, ids, lookahead=4)`); each draft is rejected with probability
0.3. Printed: host CPU time per step (both), their ratio, and the cost per committed token.
No floor: the issue asks for the figures and their ratio.
"""

from __future__ import annotations

import random
import time

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable

SEQS = 64
STEPS = 400
LOOKAHEAD = 4
REJECT = 0.3


def _table():
    cfg = KvCacheConfig(block_size=16, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    cache = PagedKvCache(cfg, 8192, HostBackend(1 << 30))
    return SequenceTable(cache, PrefixCache(cache))


def _mix(drafting: bool, steps: int, seed: int = 0) -> tuple[float, int]:
    """CPU seconds of `steps` steps, and the tokens they committed."""
    rng = random.Random(seed)
    table = _table()
    system = [rng.randrange(32000) for _ in range(256)]
    ids = list(range(SEQS))
    for s in ids:
        table.add(s, system + [rng.randrange(32000) for _ in range(256)])
    accepted = [0] * SEQS
    plan = []  # the step's random draws, made before the clock runs
    for _ in range(steps):
        row = []
        for s in ids:
            n = 1 + accepted[s] if drafting else 1
            row.append((n, [rng.randrange(32000) for _ in range(n)]))
            if drafting:
                accepted[s] = next((i for i in range(LOOKAHEAD) if rng.random() < REJECT), LOOKAHEAD)
        plan.append(row)
    append, export = table.append, table.slot_mapping
    committed = 0
    clock = time.process_time
    start = clock()
    for row in plan:
        for s, (n, toks) in zip(ids, row):
            if drafting:
                append(s, n, toks, lookahead=LOOKAHEAD)
            else:
                append(s, 1, toks)
            committed += n
        export(ids)
    spent = clock() - start
    table.check_invariants()
    return spent, committed


def run(args) -> None:
    steps = 60 if args.quick else STEPS
    rounds = 1 if args.quick else 3
    plain = min(_mix(False, steps, r) for r in range(rounds))
    draft = min(_mix(True, steps, r) for r in range(rounds))
    us_plain, us_draft = 1e6 * plain[0] / steps, 1e6 * draft[0] / steps
    print(f"  {SEQS} sequences x {steps} steps, block size 16, host CPU time (best of {rounds})")
    print(f"  no drafting:            {us_plain:8.1f} us/step  {1e6 * plain[0] / plain[1]:6.2f} us/committed token")
    print(f"  lookahead {LOOKAHEAD}, {REJECT:.0%} rejected: {us_draft:8.1f} us/step  "
          f"{1e6 * draft[0] / draft[1]:6.2f} us/committed token  ({draft[1] / plain[1]:.2f}x the tokens)")
    print(f"  drafting / plain per step: {us_draft / us_plain:.2f}x; "
          f"per committed token: {(draft[0] / draft[1]) / (plain[0] / plain[1]):.2f}x")
