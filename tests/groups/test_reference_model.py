"""A tiny hybrid model in numpy (a sliding-window attention layer, a full attention layer and
a linear recurrence layer whose state is a state group's slot) generates, greedily, exactly
the tokens with pagedkv's cache (HostBackend, SequenceTable + PrefixCache: prefix hits in
every group, checkpoints written and copied) as it does with no cache at all.

The cached engine reads every earlier position's K/V from the cache's blocks (the ones the
table lists for the step), the recurrent state from the live slot the table hands out, and
writes each step's K/V by `slot_mapping` and the state at every checkpoint position the
table names, so a window released a block early, a checkpoint filed at the wrong position or
a hit that reused another prompt's memory changes the tokens."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pagedkv import HostBackend, KvCacheConfig, PagedKvCache, PrefixCache, SequenceTable
from pagedkv.core.layer_groups import LayerGroup

BS, WINDOW, EVERY, D, VOCAB = 4, 6, 8, 16, 23
GROUPS = (
    LayerGroup("sliding", (0,), window=WINDOW),
    LayerGroup("full", (1,)),
    LayerGroup("state", (2,), state=(((D,), "float32"),), checkpoint_every=EVERY),
)


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (K and V are bf16-exact, so the cache stores them without loss)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class TinyHybrid:
    """Embedding, sliding attention (layer 0), full attention (layer 1), a diagonal linear
    recurrence `s = a * s + h @ B` (layer 2), an output projection; greedy decoding."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        w = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
        self.emb = w(VOCAB, D)
        self.wq, self.wk, self.wv, self.wo = (w(2, D, D) / 2 for _ in range(4))
        self.decay = rng.uniform(0.7, 0.95, D).astype(np.float32)
        self.b_in, self.c_out = w(D, D) / 2, w(D, D) / 2
        self.out = w(D, VOCAB)

    def kv(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return bf16(h @ self.wk[layer]), bf16(h @ self.wv[layer])

    def attend(self, layer: int, h: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        scores = keys @ (h @ self.wq[layer]) / np.sqrt(D)
        p = np.exp(scores - scores.max())
        return h + (p / p.sum()) @ values @ self.wo[layer]

    def position(self, token: int, past, state: np.ndarray):
        """One position: `past(layer, k, v)` returns that layer's keys and values of the
        earlier positions it attends to with this one's (k, v) appended. Returns the logits,
        this position's (k, v) per attention layer and the new state."""
        h = self.emb[token]
        new = {}
        for layer in (0, 1):
            k, v = self.kv(layer, h)
            new[layer] = (k, v)
            keys, values = past(layer, k, v)
            h = self.attend(layer, h, keys, values)
        state = (self.decay * state + h @ self.b_in).astype(np.float32)
        h = h + state @ self.c_out
        return h @ self.out, new, state


def generate_without_cache(model: TinyHybrid, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding from scratch, every K/V in a list."""
    seq, kvs, state = list(prompt), {0: [], 1: []}, np.zeros(D, np.float32)
    for t in range(len(prompt) + n - 1):
        def past(layer, k, v, t=t):
            rows = kvs[layer][max(0, t + 1 - WINDOW) if layer == 0 else 0:] + [(k, v)]
            return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

        logits, new, state = model.position(seq[t], past, state)
        for layer in (0, 1):
            kvs[layer].append(new[layer])
        if t >= len(prompt) - 1:
            seq.append(int(np.argmax(logits)))
    return seq[len(prompt):]


class Engine:
    """The cached engine: one step per `add`/`append`, memory only through pagedkv."""

    def __init__(self, model: TinyHybrid, blocks=(12, 40), slots=24):
        self.model, self.gpu = model, HostBackend()
        config = KvCacheConfig(BS, 1, D, 3, "bf16", layer_groups=GROUPS)
        self.cache = PagedKvCache(config, list(blocks) + [None], self.gpu, num_state_slots=slots)
        self.prefix = PrefixCache(self.cache)
        self.table = SequenceTable(self.cache, self.prefix, self.gpu)
        self.hits: list[int] = []

    def _read(self, sid, layer: int, positions: range) -> tuple[np.ndarray, np.ndarray]:
        blocks = self.table.step_blocks(sid, group=layer)
        slots = [blocks[p // BS] * BS + p % BS for p in positions]  # KeyError: a block not held
        k, v = self.cache.read_tokens(layer, slots, self.gpu)
        return k[:, 0, :], v[:, 0, :]

    def _step(self, sid, seq: list[int], start: int) -> np.ndarray:
        """Run positions [start, len(seq)) of `seq`; returns the last position's logits."""
        table, cache, gpu = self.table, self.cache, self.gpu
        (live,) = np.asarray(table.state_slots([sid])).tolist()
        state = cache.read_state(2, live, gpu)
        checkpoints = dict(table.step_checkpoints(sid))
        fresh = {0: {}, 1: {}}  # this step's K/V, by position
        for t in range(start, len(seq)):
            def past(layer, k, v, t=t):
                lo = max(0, t + 1 - WINDOW) if layer == 0 else 0
                old = range(lo, min(t, start))
                keys, values = self._read(sid, layer, old) if len(old) else (np.zeros((0, D)), np.zeros((0, D)))
                rows = [fresh[layer][p] for p in range(max(lo, start), t)] + [(k, v)]
                return (np.concatenate([keys, np.stack([r[0] for r in rows])]),
                        np.concatenate([values, np.stack([r[1] for r in rows])]))

            logits, new, state = self.model.position(seq[t], past, state)
            for layer in (0, 1):
                fresh[layer][t] = new[layer]
            if t + 1 in checkpoints:  # the state as of that position
                cache.write_state(2, checkpoints.pop(t + 1), state, gpu)
        assert not checkpoints, f"checkpoints outside the step: {checkpoints}"
        for layer in (0, 1):
            slots = np.asarray(table.slot_mapping([sid], group=layer))
            assert slots.size == len(seq) - start
            k = np.stack([fresh[layer][t][0] for t in range(start, len(seq))])[:, None, :]
            v = np.stack([fresh[layer][t][1] for t in range(start, len(seq))])[:, None, :]
            cache.write_tokens(layer, slots, k, v, gpu, 0)  # -1 (out of the window) skips
        cache.write_state(2, live, state, gpu)
        return logits

    def generate(self, sid, prompt: list[int], n: int, keep: bool = False) -> list[int]:
        hit = self.table.add(sid, prompt)
        self.hits.append(hit)
        seq = list(prompt)
        logits = self._step(sid, seq, hit)
        self.table.cache_prefix(sid)  # the prefill is written
        while len(seq) < len(prompt) + n:
            seq.append(int(np.argmax(logits)))
            if len(seq) == len(prompt) + n:
                break
            self.table.append(sid, token_ids=[seq[-1]])
            logits = self._step(sid, seq, len(seq) - 1)
        self.table.check_invariants()
        if not keep:
            self.table.free(sid)
        return seq[len(prompt):]


@pytest.mark.parametrize("blocks, slots, hits", [
    ((40, 80), 60, [0, 0, 12, 24, 24, 24, 40, 40, 32]),  # room for every chain
    ((12, 40), 24, [0, 0, 12, 24, 12, 12, 12, 12, 12]),  # eviction in every group
])
def test_a_tiny_hybrid_generates_the_same_tokens_with_the_cache_and_prefix_hits(blocks, slots, hits):
    model = TinyHybrid()
    engine = Engine(model, blocks, slots)
    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, 13).tolist()
    history = {c: list(system) for c in range(3)}
    for turn in range(3):
        for c in range(3):
            prompt = history[c] + rng.integers(0, VOCAB, int(rng.integers(3, 9))).tolist()
            got = engine.generate((turn, c), prompt, 9)
            assert got == generate_without_cache(model, prompt, 9), (turn, c)
            history[c] = prompt + got
    # the third conversation hits the branch point the second one left at the system prompt's
    # last whole block; later turns their previous turn's latest checkpoint (every 8 tokens)
    # while the cache has room for it
    assert engine.hits == hits
    engine.table.check_invariants()


def test_live_sequences_side_by_side_and_a_fork_keep_their_own_memory():
    model = TinyHybrid(seed=2)
    engine = Engine(model, blocks=(24, 60), slots=40)
    prompt = list(range(1, 19))
    first = engine.generate("a", prompt, 6, keep=True)
    assert first == generate_without_cache(model, prompt, 6)
    table = engine.table
    table.fork("a", "b")
    # both continue from the same 23 tokens (the last generated one not yet appended)
    for sid, extra in (("a", [3, 4, 5]), ("b", [9, 9])):
        seq = prompt + first[:-1] + extra
        table.append(sid, token_ids=extra)
        logits = engine._step(sid, seq, len(seq) - len(extra))
        want = generate_without_cache(model, seq, 1)
        assert [int(np.argmax(logits))] == want, sid
    # prompts that share a's start: the first leaves a branch point at 16, the next hits it
    for sid, tail in (("c", [5, 5, 5]), ("d", [6, 6])):
        other = engine.generate(sid, prompt[:17] + tail, 5)
        assert other == generate_without_cache(model, prompt[:17] + tail, 5)
    assert engine.hits[-2:] == [0, 16]
    table.check_invariants()
