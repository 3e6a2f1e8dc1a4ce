"""SequenceTable: per-sequence block tables for an engine's scheduler, over one PagedKvCache.

Each sequence holds one reference on each of its blocks. `add` reuses the prefix cache's
match and allocates the rest; `append` allocates only when a block boundary is crossed;
`fork` shares every block and copies a shared, partly filled last block on the first write
(copy-on-write); `free` offers the sequence's full, fully known blocks to the prefix cache
and drops its references tail first. With `config.cache_blocks_per_seq = N` a sequence
holds at most its N newest blocks (sliding window).

Token ids: `add` takes the prompt's ids; `append` takes ids or only a count;
`append_decode` (`decode_step`) gives many sequences one id each in one call. The table
remembers a sequence's ids up to its first token given only as a count, and only blocks
wholly inside that known run are ever offered to the prefix cache. A sequence whose window
has dropped a block is never offered (its chain no longer starts at the prompt).

Every `add`/`append` is all-or-nothing: on any error every count is as it was. With a
prefix cache over a host tier, `add` promotes the host-resident part of its match (one
`swap_in` on the table's stream) under the same rule.
"""

from __future__ import annotations

from threading import get_ident
from typing import Hashable, Sequence

from ..backends.protocol import GpuBackend
from ..cache.hybrid_cache import HybridKvCache
from ..cache.paged_cache import PagedKvCache
from ..core.guard import ThreadGuard, guarded
from ..core.streams import stream_handle
from ..core.validate import MAX_TOKEN_ID, non_negative_int, step_arguments, token_ids_and_bytes
from ..errors import KvCacheError
from .batch import KeptBatch
from .block_keys import block_keys, extra_key_ranges, with_ranges
from .decode_step import DecodeSteps
from .drafting import DraftingSteps
from .exports import ExportBuffers, Exported, LengthExports, PageTable, SequenceExports, SequenceQueries
from .hybrid_table import HybridSequenceTable
from .prefix_cache import PrefixCache, PrefixMatch, adapter_id_checked
from .reuse import PrefixReuse

__all__ = ["Exported", "PageTable", "SequenceTable"]

_MAX_TOKEN_ID = MAX_TOKEN_ID


class _Seq:
    __slots__ = (
        "blocks", "num_tokens", "tokens", "tokens_known", "dropped", "adapter_id", "step_start", "maybe_shared", "room",
        "lookahead", "salt", "row", "mark", "cached",
    )

    def __init__(self, blocks: list[int], num_tokens: int, tokens: list[int], adapter_id: int, step_start: int):
        self.blocks = blocks  # held blocks, oldest first
        self.num_tokens = num_tokens
        self.tokens = tokens  # ids of the first len(tokens) tokens
        self.tokens_known = True  # False once a token arrived as a count only
        self.dropped = 0  # blocks released at the front by the sliding window
        self.adapter_id = adapter_id
        self.step_start = step_start  # first position written by the latest add/append
        self.maybe_shared = False  # set by fork: the partly filled last block may be shared
        self.room = -1  # tokens `append` may reach without growing; -1 sends it to _grow
        self.lookahead = 0  # the last `lookahead` of num_tokens are draft positions (slots, no committed id)
        self.salt = None  # the prefix cache's key context (cache salt, extra keys) of the prompt
        self.row = -1  # row in the table's persistent batch (KeptBatch)
        self.mark = 0  # the latest append_decode call that counted this record
        self.cached: list = []  # the prefix cache's nodes of blocks[:len(cached)] when added (a walk's hint)

    def settle(self, block_size: int) -> None:
        """Recompute `room` after the blocks, `maybe_shared` or `lookahead` changed (-1, no
        room, while drafts are to be taken back first)."""
        self.room = -1 if self.maybe_shared or self.lookahead else (self.dropped + len(self.blocks)) * block_size

    def clone(self) -> "_Seq":
        other = _Seq(list(self.blocks), self.num_tokens, list(self.tokens), self.adapter_id, self.num_tokens)
        other.tokens_known, other.dropped, other.salt = self.tokens_known, self.dropped, self.salt
        other.cached = self.cached  # (never changed in place)
        return other


class SequenceTable(SequenceExports, LengthExports, SequenceQueries, DraftingSteps, DecodeSteps):
    """Block tables of live sequences. With `gpu`, new blocks are initialised (zeroed, or
    poisoned under METRALE_KV_POISON) on `stream`, copy-on-write copies run there, and
    exports are uploaded; without one, the table is bookkeeping only and the engine performs
    `take_pending_copies()` itself.

    One thread at a time: the table shares its prefix cache's guard (or has its own), and a
    call entering while another thread is inside raises ConcurrentUseError, changing
    nothing. Prefix-cache events caused by a call are delivered when the call is done.

    Over a `HybridKvCache` (a config with `layer_groups`) it is a `HybridSequenceTable`
    (`pagedkv.sequences.hybrid_table`): per-group block lists, state slots, checkpoints."""

    def __new__(cls, cache=None, *args, **kwargs):
        if cls is SequenceTable and isinstance(cache, HybridKvCache):
            return HybridSequenceTable(cache, *args, **kwargs)
        return super().__new__(cls)


    def __init__(
        self,
        cache: PagedKvCache,
        prefix_cache: PrefixCache | None = None,
        gpu: GpuBackend | None = None,
        stream: int = 0,
    ):
        if not isinstance(cache, PagedKvCache):
            raise TypeError(f"cache must be a PagedKvCache, got {type(cache).__name__}")
        if prefix_cache is not None:
            if not isinstance(prefix_cache, PrefixCache):
                raise TypeError(f"prefix_cache must be a PrefixCache, got {type(prefix_cache).__name__}")
            if cache.attached_prefix_cache() is not prefix_cache:
                raise ValueError("prefix_cache is attached to a different PagedKvCache")
            tier = prefix_cache.host_tier()
            if tier is not None and gpu is not None and gpu is not tier.gpu():
                raise ValueError("gpu is not the backend of the prefix cache's host tier")
        if gpu is not None:
            try:
                cache.pools().check_backend(gpu)
            except KvCacheError:
                raise ValueError(f"gpu {type(gpu).__name__} {gpu!r:.60} is not the backend the cache was built on "
                                 "(a table initialises and copies the cache's blocks with it)") from None
        self._cache = cache
        self._prefix = prefix_cache
        self._gpu = gpu
        self._stream = stream
        stream_handle(stream)  # an int or a __cuda_stream__ object; the object is kept for the backend
        check = getattr(gpu, "check_stream", None)
        if check is not None:  # a backend that knows its streams: an unknown one refused now
            check(stream)
        self._bs = cache.block_size()
        self._window = cache.config().cache_blocks_per_seq
        self._seqs: dict[Hashable, _Seq] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._exports = ExportBuffers(gpu, stream)
        self._batch = KeptBatch()  # rows of the live sequences and the arrays exports are cut from
        self._reuse = PrefixReuse(prefix_cache, gpu, stream) if prefix_cache is not None else None
        self._guard = prefix_cache._guard if prefix_cache is not None else ThreadGuard("this SequenceTable")
        self._guard_token = self._guard.token  # the guard's claim list, for append's inline claim

    def _deliver(self) -> None:
        prefix = self._prefix
        if prefix is not None and prefix._events.pending:
            prefix.deliver_events()

    # -- lifecycle of a sequence -------------------------------------------------------

    @guarded
    def add(self, seq_id: Hashable, prompt_tokens: Sequence[int], adapter_id: int = 0,
            cache_salt: str | bytes | None = None, extra_keys=None) -> int:
        """Start a sequence with `prompt_tokens`; returns how many leading tokens came from
        the prefix cache (whole blocks; never the last prompt token, which the engine must
        compute). Raises ValueError for a duplicate id or a prompt longer than the window,
        KvCacheExhausted when blocks run out (nothing changed). A backend error while
        initialising new blocks frees them again; cached blocks the prefix cache evicted to
        make room stay evicted (every count stays consistent).

        With a host tier, the match's continuation in host blocks is promoted before the
        sequence uses it: device blocks allocated with the others, ONE `swap_in` on the
        table's stream (the host waits for it when the table has no backend), and those
        tokens count as matched. All or nothing: a failed promotion (no device blocks, a
        swap error) leaves the sequence unadded, the host blocks cached and every count as
        it was.

        `cache_salt` and `extra_keys` key the prompt's blocks as in `PrefixCache.match`
        (a namespace; keys of the blocks they cover): the match, and every later offer of
        this sequence's blocks (`cache_prefix`, `free`, a fork's), use them."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens, data = token_ids_and_bytes(prompt_tokens, "prompt_tokens")  # raises naming a bad entry
        n = len(tokens)
        needed = -(-n // self._bs)
        if self._window is not None and needed > self._window:
            raise ValueError(
                f"prompt of {n} tokens needs {needed} blocks but the window holds {self._window}"
            )
        adapter_id = adapter_id_checked(adapter_id)
        keys = block_keys(adapter_id, cache_salt, extra_keys, self._bs)
        reuse = self._reuse
        found = reuse.reserve(data, n, adapter_id, keys) if reuse is not None else PrefixMatch([], 0)
        if found.disk_blocks:
            try:
                reuse.load(found)  # disk -> host; blocks read stay in the host tier whatever follows
            except BaseException:
                reuse.cancel(found)
                raise
        blocks, matched = found
        hosted = len(found.host_blocks)  # host-tier blocks to promote into fresh device blocks
        try:
            fresh = self._cache.alloc_blocks(needed - len(blocks))
        except BaseException:
            if reuse is not None:
                reuse.cancel(found)
            raise
        try:
            self._init(fresh[hosted:])
            if hosted:
                reuse.promote(found, fresh)
        except BaseException:
            self._cache.free_blocks(fresh)
            if reuse is not None:
                reuse.cancel(found)
            raise
        if reuse is not None:
            reuse.confirm(n, found)
        matched += hosted * self._bs
        seq = self._seqs[seq_id] = _Seq(blocks + fresh, n, tokens, adapter_id, matched)
        seq.salt = keys
        if blocks:
            seq.cached = found.path  # type: ignore[attr-defined] - a reservation's device nodes, blocks' order
        seq.settle(self._bs)
        self._batch.add(seq_id, seq)
        return matched

    def append(self, seq_id: Hashable, n_tokens: int | None = None, token_ids: Sequence[int] | None = None,
               lookahead: int = 0, extra_keys=None) -> None:
        """Extend a sequence by `n_tokens` (default: len(token_ids), else 1); `token_ids`,
        when given, are remembered so the blocks can be cached. Allocates only at a block
        boundary, copies a shared partly filled last block first, and releases the oldest
        blocks beyond the window. ValueError when the step's tokens span more blocks than
        the window; KvCacheExhausted (nothing changed) when blocks run out. A backend error
        while initialising or copying new blocks frees them again; cached blocks the prefix
        cache evicted to make room stay evicted (every count stays consistent).

        `lookahead=k` (speculative decoding) also gives `k` draft positions past the new
        committed end their slots, in this step's `slot_mapping` after the step's tokens
        (and in `block_table`, `page_table`, `seq_lens`): the drafts are not committed, so
        `num_tokens` leaves them out and they never reach the prefix cache. The next
        `append` or `truncate` takes them back first: its tokens reuse those positions (and
        their blocks, KV included) and blocks no longer needed are released.

        `extra_keys` key the appended tokens' blocks as `add`'s key the prompt's (an image's
        content hash over its placeholder tokens, ...): `(offset, length, key)` ranges with
        offsets counted from this step's first token, each within the step's `n_tokens`
        (ValueError naming it, nothing changed). When those blocks are offered to the prefix
        cache their keys (and so, under "vllm-sha256-cbor", their hashes) carry them, after
        the keys given before. `truncate` cuts ranges past the new end."""
        self._batch.gathered = False  # the exports' kept gather of token counts (KeptBatch.stale, inline)
        if extra_keys is not None:
            self._append_keyed(seq_id, n_tokens, token_ids, lookahead, extra_keys)
            return
        if lookahead:
            self._append_drafting(seq_id, n_tokens, token_ids, lookahead)
            return
        token = self._guard_token
        try:
            token.pop()  # the guard, claimed inline: a decode step's one id is the per-token hot path
        except IndexError:
            self._append(seq_id, n_tokens, token_ids)  # re-entered, or refused: the full path says which
            return
        grown = None  # stays None unless this is a decode step's one valid id
        try:
            seq = self._seqs.get(seq_id)
            if (
                seq is not None
                and type(token_ids) is list
                and (n_tokens is None or (type(n_tokens) is int and n_tokens == 1))
            ):
                try:
                    (token_id,) = token_ids
                except ValueError:
                    token_id = None
                if type(token_id) is int and 0 <= token_id <= _MAX_TOKEN_ID:
                    old = seq.num_tokens
                    if old < seq.room:  # room in a private last block (a record with drafts has none)
                        grown = False
                        seq.num_tokens = old + 1
                        seq.step_start = old
                        if seq.tokens_known:
                            seq.tokens.append(token_id)
                    elif not seq.lookahead:  # a block boundary (or a shared last block): allocate or copy
                        self._grow_claimed(seq, old)
                        grown = True
                        seq.num_tokens = old + 1
                        seq.step_start = old
                        if seq.tokens_known:
                            seq.tokens.append(token_id)
        finally:
            token.append(True)
        if grown is None:
            self._append(seq_id, n_tokens, token_ids)  # nothing changed above: the full path from the start
        elif grown:
            self._deliver()

    @guarded
    def _append_keyed(self, seq_id: Hashable, n_tokens: object, token_ids: object, lookahead: object,
                      extra_keys: object) -> None:
        """`append` with extra keys for the step's tokens: checked first, attached once the
        append succeeded."""
        seq = self._get(seq_id)
        n, _ = step_arguments(n_tokens, token_ids)
        ranges = extra_key_ranges(extra_keys)
        for i, (offset, length, _key) in enumerate(ranges):
            if offset + length > n:
                raise ValueError(
                    f"extra_keys[{i}] covers tokens [{offset}, {offset + length}) of the step, which appends {n}"
                )
        start = seq.num_tokens - seq.lookahead  # the committed end: the step's first token goes there
        self.append(seq_id, n_tokens, token_ids, lookahead)
        shifted = tuple((start + offset, length, key) for offset, length, key in ranges)
        seq.salt = with_ranges(seq.salt, seq.adapter_id, shifted, self._bs)

    def _grow_claimed(self, seq: _Seq, old: int) -> None:
        """`_grow` for one more token, with the guard's token taken by `append`: the guard
        is fully claimed meanwhile, as the allocation may call back in."""
        guard = self._guard
        guard.owner = get_ident()
        guard.depth += 1
        try:
            self._grow(seq, old, old + 1, 1)
        finally:
            guard.depth -= 1
            guard.owner = None

    def _append(self, seq_id: Hashable, n_tokens: object, token_ids: object) -> None:
        """`append`, every case (the guard not held by the caller)."""
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.lookahead:  # its drafts are taken back first: the drafting path
            self._append_drafting(seq_id, n_tokens, token_ids, 0)
            return
        guard = self._guard
        token = guard.token
        try:
            token.pop()  # the guard, claimed inline: this is the per-token hot path
            took = True
        except IndexError:
            guard.enter()  # raises ConcurrentUseError unless this thread is already inside
            took = False
        grown = False
        try:
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise KeyError(f"unknown sequence {seq_id!r}")
            if (
                type(token_ids) is list
                and len(token_ids) == 1
                and type(token_ids[0]) is int
                and 0 <= token_ids[0] <= _MAX_TOKEN_ID
                and (n_tokens is None or (type(n_tokens) is int and n_tokens == 1))
            ):  # a decode step's one id passes without building a copy
                n_tokens = 1
            else:
                n_tokens, token_ids = step_arguments(n_tokens, token_ids)
            old = seq.num_tokens
            total = old + n_tokens
            if total > seq.room:
                if took:
                    guard.owner = get_ident()  # a full claim: the allocation may call back in
                guard.depth += 1
                try:
                    self._grow(seq, old, total, n_tokens)
                finally:
                    guard.depth -= 1
                    if took:
                        guard.owner = None
                grown = True
            # else the decode fast path: room in a private last block
            seq.num_tokens = total
            seq.step_start = old
            if seq.tokens_known and n_tokens:
                if token_ids is None:
                    seq.tokens_known = False
                else:
                    seq.tokens += token_ids
        finally:
            if took:
                token.append(True)
            else:
                guard.exit()
        if grown:
            self._deliver()

    def _grow(self, seq: _Seq, old: int, total: int, n_tokens: int) -> None:
        bs, cache = self._bs, self._cache.allocator()  # the guard is held: the allocator's own calls
        have = seq.dropped + len(seq.blocks)
        if total == have * bs + 1 and not seq.maybe_shared and self._window is None:
            block = cache.alloc_block()  # a decode step crossing into a fresh block
            if self._gpu is not None:
                try:
                    self._init([block])
                except BaseException:
                    cache.dec_ref(block)
                    raise
            seq.blocks.append(block)
            self._batch.block_appended(seq)
            seq.num_tokens, seq.step_start = total, old
            seq.room = (have + 1) * bs
            return
        needed = -(-total // bs)
        if self._window is not None and n_tokens and needed - old // bs > self._window:
            raise ValueError(
                f"appending {n_tokens} tokens at position {old} spans {needed - old // bs} blocks "
                f"but the window holds {self._window}"
            )
        copy = int(bool(n_tokens and seq.maybe_shared and old % bs and cache.ref_count(seq.blocks[-1]) > 1))
        fresh = cache.alloc_blocks(max(needed - have, 0) + copy)
        try:
            self._init(fresh[copy:])
            if copy:
                self._copy(seq.blocks[-1], fresh[0])
        except BaseException:
            cache.free_blocks(fresh)
            raise
        if copy:
            shared, seq.blocks[-1] = seq.blocks[-1], fresh[0]
            cache.dec_ref(shared)
        seq.blocks.extend(fresh[copy:])
        if n_tokens:
            seq.maybe_shared = False
        released = None
        if self._window is not None and len(seq.blocks) > self._window:
            extra = len(seq.blocks) - self._window
            released, seq.blocks[:extra] = seq.blocks[:extra], []
            seq.dropped += extra
            seq.tokens, seq.tokens_known = [], False  # no longer offered to the prefix cache
        self._batch.rewrite(seq)
        if released is not None:
            cache.free_blocks(released)
        seq.num_tokens = total
        seq.step_start = old
        seq.settle(bs)

    @guarded
    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Start `dst` as a copy of `src` sharing every block (one more reference each); the
        first write of either into a shared, partly filled last block copies it first. The
        copy has `src`'s committed tokens only: drafts of a lookahead stay with `src`."""
        parent = self._get(src)
        if dst in self._seqs:
            raise ValueError(f"sequence {dst!r} already exists")
        child = parent.clone()
        if parent.lookahead:  # the child starts at the committed end: the drafts stay the parent's
            child.num_tokens = child.step_start = parent.num_tokens - parent.lookahead
            del child.blocks[max(-(-child.num_tokens // self._bs) - child.dropped, 0):]
        for block in child.blocks:
            self._cache.inc_ref(block)
        if child.num_tokens % self._bs:
            parent.maybe_shared = child.maybe_shared = True
        parent.settle(self._bs)
        child.settle(self._bs)
        self._seqs[dst] = child
        self._batch.add(dst, child)

    @guarded
    def free(self, seq_id: Hashable) -> None:
        """End a sequence: offer its full, fully known blocks to the prefix cache (when
        there is one, it is not closed and the window dropped nothing), then drop its
        references tail first."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        self._batch.remove(seq)
        try:
            if self._reuse is not None:
                self._reuse.offer(seq, self._bs)
        finally:
            self._cache.free_blocks(seq.blocks)

    @guarded
    def cache_prefix(self, seq_id: Hashable) -> int:
        """Offer a live sequence's full, fully known blocks to the prefix cache now (call it
        once their KV is written, so other requests can share them before this one ends);
        returns how many blocks were newly cached. KvCacheError when the prefix cache is
        closed."""
        seq = self._get(seq_id)
        if self._reuse is None:
            return 0
        self._prefix._check_open("cache_prefix")
        return self._reuse.offer(seq, self._bs)

    def _init(self, blocks: list[int]) -> None:
        if blocks and self._gpu is not None:
            self._cache.init_blocks(blocks, self._gpu, self._stream)

    def _copy(self, src: int, dst: int) -> None:
        if self._gpu is not None:
            self._cache.copy_blocks([(src, dst)], self._gpu, self._stream)
        else:
            self._pending_copies.append((src, dst))

    @guarded
    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write `(src, dst)` pairs a table without a backend could not perform;
        the engine must copy them (e.g. `cache.copy_blocks`) before it writes the step and
        before freeing sequences. Returns and forgets them."""
        pairs, self._pending_copies = self._pending_copies, []
        return pairs

    # -- queries -----------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    def num_tokens(self, seq_id: Hashable) -> int:
        """Committed tokens in the sequence, including any whose blocks the window released
        (not the drafts of a lookahead)."""
        seq = self._get(seq_id)
        return seq.num_tokens - seq.lookahead

    def blocks(self, seq_id: Hashable) -> list[int]:
        """The blocks the sequence holds, oldest first (a copy)."""
        return list(self._get(seq_id).blocks)

    def first_block_position(self, seq_id: Hashable) -> int:
        """Token position where the first held block starts (non-zero once the window
        released blocks)."""
        return self._get(seq_id).dropped * self._bs

    def block_references(self) -> dict[int, int]:
        """block -> references the live sequences hold."""
        refs: dict[int, int] = {}
        for seq in self._seqs.values():
            for block in seq.blocks:
                refs[block] = refs.get(block, 0) + 1
        return refs

    @guarded
    def check_invariants(self) -> None:
        """Check the cache's invariants, the prefix cache's, that every block's count
        equals the references this table and its prefix cache hold (assumes they are the
        cache's only users), and that the persistent batch's kept arrays equal a rebuild
        from the sequences. O(num_blocks + held blocks)."""
        held = self.block_references()
        if self._prefix is not None:
            self._prefix.check_invariants()
            for block in self._prefix.block_references():
                held[block] = held.get(block, 0) + 1
        partial_owners: dict[int, list[_Seq]] = {}
        for seq_id, seq in self._seqs.items():
            capacity = (seq.dropped + len(seq.blocks)) * self._bs
            if not capacity - self._bs < seq.num_tokens <= capacity:
                raise KvCacheError(f"sequence {seq_id!r} holds {len(seq.blocks)} blocks for {seq.num_tokens} tokens")
            if seq.num_tokens % self._bs:
                partial_owners.setdefault(seq.blocks[-1], []).append(seq)
        for block, owners in partial_owners.items():
            if len(owners) > 1 and not all(seq.maybe_shared for seq in owners):
                raise KvCacheError(f"partly filled block {block} is shared without copy-on-write pending")
        self._batch.check(self._seqs)
        self._cache.check_invariants(held)

    # -- release -----------------------------------------------------------------------

    def label(self) -> str:
        """A short name for teardown messages."""
        return f"SequenceTable({len(self._seqs)} sequences)"

    @guarded
    def release(self, gpu: GpuBackend | None = None) -> None:
        """Free the export buffers on the table's backend (`gpu` if it has none); the
        sequences and their blocks stay. Every buffer is attempted and the first error
        raised; a buffer whose free failed stays recorded, so another call retries it.
        Once all are freed a further call does nothing."""
        self._exports.release(gpu)
