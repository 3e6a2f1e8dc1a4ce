"""Serving-path benchmark: one serving mix run two ways side by side, plus the two prefix-cache
operations the mix leans on, each printed beside its floor.

The mix: 256 sequences decode one token per step for 512 steps after a warm-up; every prompt
starts with the same 1,024-token system prompt; a sequence that reaches its length is freed
(its full blocks offered to the prefix cache) and a new one arrives in its place, a quarter
of them repeating an earlier prompt; the cache is sized so that finished sequences' cached
blocks must be evicted to make room. It runs once through `SequenceTable` and once as the
same work written directly against `PagedKvCache` and `PrefixCache`; the floor is
SequenceTable within 1.1x of the direct path.

The prefix operations (direct path, 4,096-token prompt, block size 16): `match` + `free_blocks`
of a fully cached prompt, and the first-time `insert` of a prompt. Their floor is 1.3x faster
than the figures measured on commit bcc1fa4 (before the serving-path work); those reference
figures are this file's constants and hold for the machine they were measured on only.
"""

from __future__ import annotations

import logging
import random
import time

import structlog

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable

BLOCK_SIZE = 16
NUM_SEQS = 256
STEPS = 512
WARMUP_STEPS = 128
SYSTEM_PROMPT = 1024
NUM_BLOCKS = 9_000
PROMPT_4K = 4096

# Best single call of this file's two prefix measurements on commit bcc1fa4 (2-core shared
# helper machine, 700 and 350 calls), in us; compare on the same machine only.
REFERENCE_MATCH_FREE_US = 263.7
REFERENCE_INSERT_US = 935.5


def _cache(num_blocks: int) -> PagedKvCache:
    config = KvCacheConfig(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=16, num_layers=1, dtype="bf16")
    return PagedKvCache(config, num_blocks, HostBackend(capacity_bytes=1 << 30))


def _schedule(seed: int, steps: int) -> tuple[list[int], list[list[tuple[list[int], list[int]]]]]:
    """The system prompt, and per slot its lives in order: (prompt ids, decode ids), enough
    for `steps` steps."""
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(SYSTEM_PROMPT)]
    earlier: list[list[int]] = []
    slots = []
    for _ in range(NUM_SEQS):
        lives, used = [], 0
        while used <= steps:
            if earlier and rng.random() < 0.25:
                prompt = rng.choice(earlier)
            else:
                prompt = system + [rng.randrange(32_000) for _ in range(rng.randrange(32, 257))]
                earlier.append(prompt)
            decode = [rng.randrange(32_000) for _ in range(rng.randrange(16, 385))]
            lives.append((prompt, decode))
            used += len(decode)
        slots.append(lives)
    return system, slots


def _table_steps(system, schedule, total: int, out: dict):
    """The mix through SequenceTable, one step per `next()`; checks the invariants at the end."""
    cache = _cache(NUM_BLOCKS)
    table = SequenceTable(cache, PrefixCache(cache))
    table.add("system", system)  # the engine keeps the system prompt cached and held
    table.cache_prefix("system")
    add, append, free = table.add, table.append, table.free
    life = [0] * NUM_SEQS
    pos = [0] * NUM_SEQS
    for s in range(NUM_SEQS):
        add((s, 0), schedule[s][0][0])
    for _ in range(total):
        yield
        for s in range(NUM_SEQS):
            decode = schedule[s][life[s]][1]
            p = pos[s]
            if p == len(decode):
                free((s, life[s]))
                life[s] += 1
                pos[s] = p = 0
                prompt, decode = schedule[s][life[s]]
                add((s, life[s]), prompt)
            append((s, life[s]), 1, [decode[p]])
            pos[s] = p + 1
    yield
    table.check_invariants()
    out["evictions"] = cache.attached_prefix_cache().stats().evictions


def _direct_steps(system, schedule, total: int, out: dict):
    """The same mix written directly against PagedKvCache and PrefixCache."""
    bs = BLOCK_SIZE
    cache = _cache(NUM_BLOCKS)
    prefix = PrefixCache(cache)
    system_blocks = cache.alloc_blocks(len(system) // bs)
    prefix.insert(system, system_blocks)
    match, insert = prefix.match, prefix.insert
    alloc_block, alloc_blocks, free_blocks = cache.alloc_block, cache.alloc_blocks, cache.free_blocks
    life = [0] * NUM_SEQS
    pos = [0] * NUM_SEQS
    seqs: list[list] = [None] * NUM_SEQS  # type: ignore[list-item]

    def start_seq(prompt: list[int]) -> list:
        n = len(prompt)
        blocks = match(prompt[: n - 1]).blocks
        blocks += alloc_blocks(-(-n // bs) - len(blocks))
        return [blocks, list(prompt), n]

    def end_seq(seq: list) -> None:
        blocks, tokens, n = seq
        full = n // bs
        insert(tokens[: full * bs], blocks[:full])
        free_blocks(blocks)

    for s in range(NUM_SEQS):
        seqs[s] = start_seq(schedule[s][0][0])
    for _ in range(total):
        yield
        for s in range(NUM_SEQS):
            decode = schedule[s][life[s]][1]
            p = pos[s]
            if p == len(decode):
                end_seq(seqs[s])
                life[s] += 1
                pos[s] = p = 0
                prompt, decode = schedule[s][life[s]]
                seqs[s] = start_seq(prompt)
            seq = seqs[s]
            n = seq[2]
            if n == len(seq[0]) * bs:
                seq[0].append(alloc_block())
            seq[1].append(decode[p])
            seq[2] = n + 1
            pos[s] = p + 1
    yield
    prefix.check_invariants()
    held = prefix.block_references()
    for seq in seqs + [[system_blocks]]:
        for block in seq[0]:
            held[block] = held.get(block, 0) + 1
    cache.check_invariants(held)
    out["evictions"] = prefix.stats().evictions


def _lockstep(system, schedule, steps: int, warmup: int) -> tuple[list[float], list[float], int]:
    """Run both ways step by step, alternating, so a busy machine slows both alike;
    returns each way's seconds per timed step (after `warmup` steps) and the evictions."""
    out_table: dict = {}
    out_direct: dict = {}
    ways = [_table_steps(system, schedule, warmup + steps, out_table), _direct_steps(system, schedule, warmup + steps, out_direct)]
    for way in ways:
        next(way)  # set up: every sequence added
    spent: list[list[float]] = [[], []]
    clock = time.perf_counter
    for step in range(warmup + steps):
        for i, way in enumerate(ways):
            start = clock()
            next(way)
            if step >= warmup:
                spent[i].append(clock() - start)
    for way in ways:
        for _ in way:  # the invariant checks
            pass
    if out_table["evictions"] != out_direct["evictions"]:
        raise AssertionError(f"the two ways evicted differently: {out_table} vs {out_direct}")
    return spent[0], spent[1], out_table["evictions"]


def _mix(repeats: int, steps: int, warmup: int) -> None:
    system, schedule = _schedule(1234, warmup + steps)
    best_table = best_direct = [float("inf")] * steps
    evictions = 0
    for _ in range(repeats):  # the schedule is fixed: step i does the same work every repeat
        table, direct, evictions = _lockstep(system, schedule, steps, warmup)
        best_table = list(map(min, best_table, table))
        best_direct = list(map(min, best_direct, direct))
    us_table, us_direct = sum(best_table) / steps * 1e6, sum(best_direct) / steps * 1e6
    ratio = us_table / us_direct
    print(
        f"serving mix, {NUM_SEQS} seqs x {steps} steps: SequenceTable {us_table:8.1f} us/step   "
        f"direct PagedKvCache+PrefixCache {us_direct:8.1f} us/step   ratio {ratio:5.2f}x (target <= 1.1x)"
        f"{'' if ratio <= 1.1 else '  MISSED'}\n"
        f"  ({evictions} prefix-cache evictions each way; the two ways run step by step, alternating;\n"
        f"  each step's best of {repeats} repeats, summed)"
    )


def _prompt_cache() -> tuple[PagedKvCache, PrefixCache, list[int], list[int]]:
    cache = _cache(PROMPT_4K // BLOCK_SIZE + 8)
    prefix = PrefixCache(cache)
    rng = random.Random(99)
    prompt = [rng.randrange(32_000) for _ in range(PROMPT_4K)]
    blocks = cache.alloc_blocks(PROMPT_4K // BLOCK_SIZE)
    return cache, prefix, prompt, blocks


def _floor_line(label: str, us: float, reference: float | None) -> str:
    if reference is None:
        return f"{label} {us:8.1f} us/call   (no reference figure recorded)"
    speedup = reference / us
    verdict = "" if speedup >= 1.3 else "  MISSED"
    return f"{label} {us:8.1f} us/call   bcc1fa4 {reference:8.1f} us/call   {speedup:5.2f}x faster (target >= 1.3x){verdict}"


def _match_free(calls: int, repeats: int) -> None:
    cache, prefix, prompt, blocks = _prompt_cache()
    prefix.insert(prompt, blocks)
    cache.free_blocks(blocks)

    clock, best = time.perf_counter, float("inf")
    for _ in range(repeats * calls):  # the best single call: a busy machine only adds time
        start = clock()
        cache.free_blocks(prefix.match(prompt).blocks)
        best = min(best, clock() - start)
    prefix.check_invariants()
    cache.check_invariants(prefix.block_references())
    print(_floor_line("match + free_blocks, cached 4096-token prompt:", best * 1e6, REFERENCE_MATCH_FREE_US))


def _insert(calls: int, repeats: int) -> None:
    cache, prefix, prompt, blocks = _prompt_cache()
    best = float("inf")
    for _ in range(repeats * calls):  # the best single call
        start = time.perf_counter()
        prefix.insert(prompt, blocks)
        best = min(best, time.perf_counter() - start)
        prefix.clear()
    cache.check_invariants({b: 1 for b in blocks})
    print(_floor_line("first-time insert, 4096-token prompt:         ", best * 1e6, REFERENCE_INSERT_US))


def run(args) -> None:
    """Print the serving mix both ways and the two prefix-cache floors; `args.quick` runs a
    short mix with fewer repetitions."""
    quick = getattr(args, "quick", False)
    repeats = 2 if quick else 7
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    _mix(repeats, 32 if quick else STEPS, 16 if quick else WARMUP_STEPS)
    _match_free(10 if quick else 100, repeats)
    _insert(5 if quick else 50, repeats)
