"""KV block-id allocator: the scheduler's exact accounting of the executor's paged KV cache.

The executor owns the KV tensors; this pool only hands out block *ids* and remembers which
request holds which. A request's blocks cover positions `[0, len(blocks) * block_size)`; the
scheduler grows them before a round writes rows and shrinks them to the committed length after.

A block is in exactly one of three states:
- free: uncached and held by nobody (`_free`, a LIFO list: recently freed blocks are warm);
- cached: content-addressed by a key (`register`), shared read-only by `ref` requests; with
  `ref == 0` it is evictable and waits in `_evictable` in LRU order, still findable by `lookup`;
- private: held by exactly one request and not cached.
Allocation takes free blocks first and evicts the least recently released cached block only
when none is left, so `num_free` counts both free and evictable blocks: a pool with no requests
has `num_free == num_total` again, whatever it caches.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict


class KVCapacityError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (nothing is changed)."""


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_total = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # req_id -> block ids in table order; a missing request reads as an empty table, so the
        # batched allocation appends without a lookup-or-create per request.
        self._held: defaultdict[int, list[int]] = defaultdict(list)
        # cached blocks: id -> number of tables holding it; key -> id and id -> key
        self._ref: dict[int, int] = {}
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        # cached blocks nobody holds, least recently released first (evicted in that order)
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by requests (a shared block counts once)."""
        return self.num_total - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.num_used / self.num_total

    @property
    def num_cached(self) -> int:
        """Content-addressed blocks, held or evictable."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def tables(self) -> dict[int, list[int]]:
        """req_id -> its block ids in table order, the pool's own lists: for read-only lookups
        in per-request hot loops (one dict access instead of a method call); change blocks only
        through the methods below. Look up only requests that hold blocks: indexing a missing
        one adds an empty table."""
        return self._held

    def blocks_of(self, req_id: int) -> tuple[int, ...]:
        return tuple(self._held.get(req_id, ()))

    def blocks_from(self, req_id: int, start: int) -> tuple[int, ...]:
        """The request's block ids from table index `start` on."""
        held = self._held.get(req_id)
        return tuple(held[start:]) if held else ()

    def num_blocks_of(self, req_id: int) -> int:
        held = self._held.get(req_id)
        return len(held) if held else 0

    def holds(self, req_id: int) -> bool:
        return req_id in self._held

    # ---------------------------------------------------------------- allocation

    def _take(self, num: int) -> list[int]:
        """`num` (>= 1, <= num_free) block ids off the free list, then evicted cached ones."""
        free = self._free
        if num <= len(free):
            new_ids = free[-num:]
            del free[-num:]
            new_ids.reverse()
            return new_ids
        new_ids = free[::-1]
        free.clear()
        evictable, by_key, key_of, ref = self._evictable, self._by_key, self._key_of, self._ref
        for _ in range(num - len(new_ids)):
            block, _ = evictable.popitem(last=False)
            del by_key[key_of.pop(block)]
            del ref[block]
            new_ids.append(block)
        return new_ids

    def allocate(self, req_id: int, num_blocks: int) -> tuple[int, ...]:
        """Appends `num_blocks` new blocks to the request's table; returns the new ids."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free:
            raise KVCapacityError(
                f"request {req_id} needs {num_blocks} KV blocks, {self.num_free} free"
            )
        held = self._held[req_id]
        if num_blocks == 0:
            return ()
        new_ids = self._take(num_blocks)
        held.extend(new_ids)
        return tuple(new_ids)

    def allocate_many(self, req_ids: list[int], counts: list[int]) -> list[int]:
        """`allocate(req_ids[i], counts[i])` for every i, in order (the same ids those calls
        would hand out), with one check and one cut of the free list. Returns the new ids in
        that order, flat."""
        total = sum(counts)
        if total > self.num_free:
            raise KVCapacityError(
                f"{len(req_ids)} requests need {total} KV blocks, {self.num_free} free"
            )
        if total == 0:
            return []
        new_ids = self._take(total)
        if total == len(req_ids) and 0 not in counts:
            return self._hand_out_one_each(req_ids, new_ids)  # every count is 1
        held = self._held
        start = 0
        for req_id, num in zip(req_ids, counts):
            held[req_id].extend(new_ids[start : start + num])
            start += num
        return new_ids

    def allocate_one_each(self, req_ids: list[int]) -> list[int]:
        """`allocate_many(req_ids, [1] * len(req_ids))`: one block per request (the decode
        rows' common case), without the per-request counts."""
        num = len(req_ids)
        if num > self.num_free:
            raise KVCapacityError(f"{num} requests need {num} KV blocks, {self.num_free} free")
        if num == 0:
            return []
        return self._hand_out_one_each(req_ids, self._take(num))

    def _hand_out_one_each(self, req_ids: list[int], new_ids: list[int]) -> list[int]:
        held = self._held
        for req_id, block in zip(req_ids, new_ids):  # no slicing per request
            held[req_id].append(block)
        return new_ids

    def extend_to(self, req_id: int, num_tokens: int) -> tuple[int, ...]:
        """Grows the request's table to cover `num_tokens` positions; returns the new ids."""
        need = num_blocks_for(num_tokens, self.block_size) - self.num_blocks_of(req_id)
        return self.allocate(req_id, need) if need > 0 else ()

    # ---------------------------------------------------------------- release

    def _release(self, blocks: list[int]) -> None:
        """Gives back one table's hold on `blocks`, last first: private blocks become free, cached
        ones lose a reference and, at none, become evictable (a table's tail, the least shared
        part, is evicted before its head)."""
        ref = self._ref
        if not ref:
            self._free.extend(reversed(blocks))
            return
        free, evictable = self._free, self._evictable
        for block in reversed(blocks):
            count = ref.get(block)
            if count is None:
                free.append(block)
            elif count > 1:
                ref[block] = count - 1
            else:
                ref[block] = 0
                evictable[block] = None

    def truncate_to(self, req_id: int, num_tokens: int) -> int:
        """Frees the request's blocks past `num_tokens` positions; returns how many were freed."""
        held = self._held.get(req_id)
        if not held:
            return 0
        keep = num_blocks_for(max(num_tokens, 0), self.block_size)
        if keep >= len(held):
            return 0
        dropped = held[keep:]
        del held[keep:]
        self._release(dropped)
        return len(dropped)

    def free(self, req_id: int) -> int:
        """Returns all of the request's blocks to the pool; returns how many."""
        held = self._held.pop(req_id, None)
        if not held:
            return 0
        self._release(held)
        return len(held)

    # ---------------------------------------------------------------- the prefix cache

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (a chain of block keys)."""
        by_key = self._by_key
        found = []
        for key in keys:
            block = by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of the cached `blocks` nobody holds (sharing them takes them off num_free)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def share(self, req_id: int, blocks: list[int]) -> None:
        """Starts the request's (empty) table with the cached `blocks`, read-only."""
        held = self._held[req_id]
        if held:
            raise ValueError(f"request {req_id} already holds blocks")
        ref, evictable = self._ref, self._evictable
        for block in blocks:
            count = ref[block]
            if count == 0:
                del evictable[block]
            ref[block] = count + 1
        held.extend(blocks)

    def register(self, req_id: int, first: int, keys: list[bytes]) -> int:
        """Caches the request's blocks at table indices `first`, `first + 1`, ... under `keys`;
        their KV must be complete. A block already cached keeps its key, and a key already
        cached keeps its block (this one stays private). Returns how many were cached."""
        held = self._held[req_id]
        ref, by_key, key_of = self._ref, self._by_key, self._key_of
        num = 0
        for block, key in zip(held[first : first + len(keys)], keys):
            if block in ref or key in by_key:
                continue
            ref[block] = 1
            by_key[key] = block
            key_of[block] = key
            num += 1
        return num

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def check(self) -> None:
        """Asserts the accounting invariants (used by tests and the simulator): every id is
        free, evictable, private to one table or cached with a reference per table holding it;
        the key maps are each other's inverse."""
        counts: defaultdict[int, int] = defaultdict(int)
        for req_id, ids in self._held.items():
            if len(set(ids)) != len(ids):
                raise AssertionError(f"request {req_id} holds a block twice")
            for b in ids:
                counts[b] += 1
        free, evictable = set(self._free), set(self._evictable)
        held = set(counts)
        parts = len(self._free) + len(self._evictable) + len(held)
        if (
            parts != self.num_total
            or len(free) != len(self._free)
            or free & evictable
            or (free | evictable) & held
            or len(free | evictable | held) != self.num_total
        ):
            raise AssertionError(
                f"block accounting broken: {len(held)} held + {len(self._free)} free + "
                f"{len(self._evictable)} evictable != {self.num_total} or overlaps"
            )
        for b in held:
            if b in self._ref:
                if self._ref[b] != counts[b]:
                    raise AssertionError(f"block {b}: ref {self._ref[b]}, {counts[b]} tables")
            elif counts[b] != 1:
                raise AssertionError(f"private block {b} in {counts[b]} tables")
        if any(self._ref.get(b) != 0 for b in evictable) or free & set(self._ref):
            raise AssertionError("an evictable block is referenced or a free block is cached")
        if set(self._ref) != set(self._key_of) or len(self._by_key) != len(self._key_of):
            raise AssertionError("cache maps disagree")
        if any(self._by_key.get(k) != b for b, k in self._key_of.items()):
            raise AssertionError("cache maps are not inverse")
