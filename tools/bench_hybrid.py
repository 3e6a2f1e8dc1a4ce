"""Hybrid section of tools/bench.py (`--section hybrid`): layer groups against an
all-full-attention cache of the same layers.

- bytes per sequence at 8k / 32k / 128k tokens for three layer patterns (Gemma-3-27B-like:
  62 layers, 5 sliding of 1,024 tokens per full, 16 KV heads x 128; gpt-oss-120b-like: 36
  layers alternating 128-token windows and full, 8 x 64; a Jamba/Nemotron-H-like stack: 32
  layers, 1 attention (8 x 128) per 7 Mamba-2 layers with conv state (3, 10240) and SSM state
  (128, 64, 128), both bf16, as in Nemotron-H-8B's config), all bf16, block 16: the ratio to
  every layer holding full attention; ceiling 0.25x for the Gemma-like pattern at 128k;
- prefix hit rate on a seeded multi-turn chat workload (a shared system prompt, each turn
  the previous conversation plus a new user message, replies decoded into the sequence):
  tokens reused / prompt tokens, beside the oracle (every earlier prefix kept, at the
  match unit): floor 0.9x of the oracle per pattern. Bookkeeping only (the same groups,
  windows and block sizes at 1 KV head x 16, state of 4 floats), HostBackend, a cache of a
  fixed size so eviction runs; state groups checkpoint every 256 tokens. The engine modelled
  calls `cache_prefix` once a prompt's prefill is written and again at its turn's end;
  4 conversations decode at once, the oldest freed when a fifth arrives;
- the same workload with a device cache of a quarter of that size, without and with a
  `HybridHostTier` holding the rest (evicted entries of every group demoted, promoted back at
  a hit): both rates and their ratio; floor 0.9x of the oracle with the host tier; and with
  a host tier of a ninth of that over a `HybridDiskTier` in a temporary directory (host drops
  of every group written to disk, staged back through host blocks at a hit): its rate beside
  that host tier alone, and the share of hit tokens only the disk gave; floor 0.9x of the
  oracle;
- bookkeeping per decode step: `append` of one token to 64 sequences, the hybrid table
  against a one-group SequenceTable of the same layers (a ratio; no floor).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np

from floors import ceiling, floor

from pagedkv import (HostBackend, HybridDiskTier, HybridHostTier, KvCacheConfig, PagedKvCache, PrefixCache,
                     SequenceTable)
from pagedkv.core.layer_groups import LayerGroup
from pagedkv.groups.layout import GroupLayout

BLOCK = 16
CONTEXTS = (8192, 32768, 131072)
MAMBA2_STATE = (((3, 10240), "bfloat16"), ((128, 64, 128), "bfloat16"))


def _state(specs):
    import ml_dtypes

    return tuple((shape, np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)) for shape, dt in specs)


def patterns(small: bool = False) -> dict:
    """name -> (num_layers, heads, head_dim, layer groups); `small`: 1 x 16 and a tiny state."""
    state = (((4,), "float32"),) if small else MAMBA2_STATE
    every = 256

    def gemma():
        kinds = ["sliding" if i % 6 != 5 else "full" for i in range(62)]
        return 62, 16, 128, (LayerGroup("sliding", [i for i, k in enumerate(kinds) if k == "sliding"], window=1024),
                             LayerGroup("full", [i for i, k in enumerate(kinds) if k == "full"]))

    def gpt_oss():
        return 36, 8, 64, (LayerGroup("sliding", list(range(0, 36, 2)), window=128),
                           LayerGroup("full", list(range(1, 36, 2))))

    def mamba():
        attention = [i for i in range(32) if i % 8 == 7]
        return 32, 8, 128, (LayerGroup("state", [i for i in range(32) if i % 8 != 7], state=_state(state),
                                       checkpoint_every=every),
                            LayerGroup("full", attention))

    out = {}
    for name, make in (("gemma3-27b-like", gemma), ("gpt-oss-120b-like", gpt_oss), ("nemotron-h-like", mamba)):
        layers, heads, dim, groups = make()
        if small:
            heads, dim = 1, 16
        out[name] = KvCacheConfig(BLOCK, heads, dim, layers, "bf16", layer_groups=groups)
    return out


def bytes_per_sequence() -> None:
    print("  bytes per sequence (hybrid / every layer full attention):")
    for name, config in patterns().items():
        layout = GroupLayout(config)
        cells = []
        for context in CONTEXTS:
            hybrid = layout.total_bytes_per_sequence(context)
            full = config.block_bytes_kv_all_layers() * -(-context // BLOCK)
            cells.append(f"{context // 1024}k {hybrid / 2**20:,.0f} MiB / {full / 2**20:,.0f} MiB = {hybrid / full:.3f}x")
            if context == 131072 and name.startswith("gemma"):
                ratio_128k = hybrid / full
        print(f"    {name:<18} " + "; ".join(cells))
    ceiling("gemma3-27b-like bytes per sequence at 128k vs all-full", ratio_128k, 0.25)


def workload(seed: int, conversations: int, turns: int) -> list[tuple[int, list[int], list[int]]]:
    """(conversation, prompt, reply) in arrival order: round-robin over conversations."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 50_000, 600).tolist()
    history = {c: list(system) for c in range(conversations)}
    out = []
    for _ in range(turns):
        for c in range(conversations):
            user = rng.integers(1, 50_000, int(rng.integers(30, 200))).tolist()
            prompt = history[c] + user
            reply = rng.integers(1, 50_000, int(rng.integers(30, 300))).tolist()
            out.append((c, prompt, reply))
            history[c] = prompt + reply
    return out


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def hit_rates(quick: bool) -> None:
    conversations, turns = (8, 3) if quick else (16, 5)
    requests = workload(7, conversations, turns)
    seen: list[list[int]] = []
    oracle_tokens = prompt_tokens = 0
    oracle_by_request = []
    for _, prompt, reply in requests:
        best = max((_lcp(prompt[:-1], s) for s in seen), default=0)
        oracle_by_request.append((best // BLOCK) * BLOCK)
        seen.append(prompt + reply)
    oracle_tokens = sum(oracle_by_request)
    prompt_tokens = sum(len(p) for _, p, _ in requests)
    print(f"  prefix hit rate, {len(requests)} requests of {conversations} conversations x {turns} turns "
          f"(oracle {oracle_tokens / prompt_tokens:.3f} of {prompt_tokens:,} prompt tokens):")
    for name, config in patterns(small=True).items():
        rate, groups = _serve(config, requests, 6)
        print(f"    {name:<18} {rate:.3f} ({groups})")
        floor(f"{name} hit rate vs the oracle", rate / (oracle_tokens / prompt_tokens), 0.9)
    print("  the same with a device cache of a quarter of that size, without and with a host tier (the rest);")
    print("  last, a host tier of a ninth of that over a disk tier (disk: the share of hit tokens only the disk gave):")
    for name, config in patterns(small=True).items():
        small, _ = _serve(config, requests, 1.5)
        tiered, _ = _serve(config, requests, 1.5, host_scale=4.5)
        disk_share = []
        disked, _ = _serve(config, requests, 1.5, host_scale=0.5, disk=disk_share)
        print(f"    {name:<18} device only {small:.3f}, with a host tier {tiered:.3f} ({tiered / max(small, 1e-9):.2f}x), "
              f"a ninth of it {_serve(config, requests, 1.5, host_scale=0.5)[0]:.3f}, over a disk tier {disked:.3f} "
              f"(disk {disk_share[0]:.2f})")
        floor(f"{name} hit rate, a quarter-size device cache with a host tier, vs the oracle",
              tiered / (oracle_tokens / prompt_tokens), 0.9)
        floor(f"{name} hit rate, a ninth of that host tier over a disk tier, vs the oracle",
              disked / (oracle_tokens / prompt_tokens), 0.9)


def _serve(config, requests, scale: float, host_scale: float = 0, disk: list | None = None) -> tuple[float, str]:
    """The hit rate of serving `requests` with a device cache of `scale` sequences' worth of
    blocks per live conversation (and a HybridHostTier of `host_scale` when given; with
    `disk`, a list, a HybridDiskTier below it and the share of hit tokens only the disk gave
    appended to the list)."""
    gpu = HostBackend()
    layout = GroupLayout(config)
    live = 4  # conversations decoding at once
    per_seq = [layout.blocks_per_sequence(g, 4000) if layout.groups[g].is_attention() else None
               for g in range(layout.num_groups())]
    blocks = [None if n is None else int(n * live * scale) for n in per_seq]
    slots = int(live * 40 * scale / 6)
    cache = PagedKvCache(config, blocks, gpu, num_state_slots=slots if layout.state_groups() else None)
    tier = None
    if host_scale:
        tier = HybridHostTier(cache, [None if n is None else int(n * live * host_scale) for n in per_seq], gpu,
                              num_state_slots=int(slots * host_scale / scale) if layout.state_groups() else None)
    directory = disk_tier = None
    if disk is not None:
        directory = tempfile.mkdtemp(prefix="pagedkv-bench-hdisk-")
        disk_tier = HybridDiskTier(directory, 1 << 28)
    prefix = PrefixCache(cache, host_tier=tier, disk_tier=disk_tier)
    table = SequenceTable(cache, prefix)
    hits = 0
    active: list[int] = []
    for i, (_, prompt, reply) in enumerate(requests):
        hits += table.add(i, prompt)
        table.take_pending_copies()  # the engine performs them (checkpoint -> live slot) before its step
        table.cache_prefix(i)  # the engine, once the prefill step's KV and checkpoints are written
        table.append(i, token_ids=reply)
        table.cache_prefix(i)  # and at the turn's end
        active.append(i)
        if len(active) >= live:
            table.free(active.pop(0))
    for i in active:
        table.free(i)
    groups = ", ".join(f"{g.kind} {cache.num_blocks(group=k):,}" for k, g in enumerate(layout.groups))
    if disk is not None:
        stats = prefix.stats()
        disk.append(stats.disk_hit_tokens / max(stats.hit_tokens, 1))
    prefix.close()
    if disk_tier is not None:
        disk_tier.close()
        shutil.rmtree(directory, ignore_errors=True)
    if tier is not None:
        tier.release(gpu)
    cache.release(gpu)
    return hits / sum(len(p) for _, p, _ in requests), groups


def decode_cost(quick: bool) -> None:
    steps = 100 if quick else 400
    print(f"  bookkeeping per decode step (64 sequences x {steps} appends of one token):")
    for name, config in patterns(small=True).items():
        plain = KvCacheConfig(BLOCK, 1, 16, config.num_layers, "bf16")
        times = {}
        for label, cfg in (("one group", plain), ("hybrid", config)):
            gpu = HostBackend()
            layout = GroupLayout(cfg)
            n = 64 * (-(-(512 + steps) // BLOCK) + 1)
            blocks = n if not cfg.layer_groups else [n if g.is_attention() else None for g in layout.groups]
            cache = PagedKvCache(cfg, blocks, gpu, **({"num_state_slots": 128} if layout.state_groups() else {}))
            table = SequenceTable(cache)
            for s in range(64):
                table.add(s, list(range(512)))
            start = time.perf_counter()
            for step in range(steps):
                for s in range(64):
                    table.append(s, token_ids=[step])
            times[label] = (time.perf_counter() - start) / (steps * 64)
            cache.release(gpu)
        print(f"    {name:<18} one group {times['one group'] * 1e6:.2f} us, hybrid {times['hybrid'] * 1e6:.2f} us "
              f"per append ({times['hybrid'] / times['one group']:.1f}x)")


def run(args) -> None:
    bytes_per_sequence()
    hit_rates(args.quick)
    decode_cost(args.quick)
