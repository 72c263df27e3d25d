"""KV block-id allocator: the scheduler's exact accounting of the executor's paged KV cache.

The executor owns the KV tensors; this pool only hands out block *ids* and remembers which
request holds which. A request's blocks cover positions `[0, len(blocks) * block_size)`; the
scheduler grows them before a round writes rows and shrinks them to the committed length after.
Every id is either free or held by exactly one request, so `num_free + sum(held) == num_total`
always, and a pool with no requests has every block free again.
"""

from __future__ import annotations

from collections import defaultdict


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
        # LIFO free list: recently freed blocks are reused first (warm in the device caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # req_id -> block ids in table order; a missing request reads as an empty table, so the
        # batched allocation appends without a lookup-or-create per request.
        self._held: defaultdict[int, list[int]] = defaultdict(list)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.num_used / self.num_total

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

    def allocate(self, req_id: int, num_blocks: int) -> tuple[int, ...]:
        """Appends `num_blocks` new blocks to the request's table; returns the new ids."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise KVCapacityError(
                f"request {req_id} needs {num_blocks} KV blocks, {len(self._free)} free"
            )
        held = self._held[req_id]
        if num_blocks == 0:
            return ()
        new_ids = self._free[-num_blocks:]
        del self._free[-num_blocks:]
        new_ids.reverse()
        held.extend(new_ids)
        return tuple(new_ids)

    def allocate_many(self, req_ids: list[int], counts: list[int]) -> list[int]:
        """`allocate(req_ids[i], counts[i])` for every i, in order (the same ids those calls
        would hand out), with one check and one cut of the free list. Returns the new ids in
        that order, flat."""
        total = sum(counts)
        if total > len(self._free):
            raise KVCapacityError(
                f"{len(req_ids)} requests need {total} KV blocks, {len(self._free)} free"
            )
        if total == 0:
            return []
        new_ids = self._free[-total:]
        del self._free[-total:]
        new_ids.reverse()
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
        if num > len(self._free):
            raise KVCapacityError(f"{num} requests need {num} KV blocks, {len(self._free)} free")
        if num == 0:
            return []
        new_ids = self._free[-num:]
        del self._free[-num:]
        new_ids.reverse()
        return self._hand_out_one_each(req_ids, new_ids)

    def _hand_out_one_each(self, req_ids: list[int], new_ids: list[int]) -> list[int]:
        held = self._held
        for req_id, block in zip(req_ids, new_ids):  # no slicing per request
            held[req_id].append(block)
        return new_ids

    def extend_to(self, req_id: int, num_tokens: int) -> tuple[int, ...]:
        """Grows the request's table to cover `num_tokens` positions; returns the new ids."""
        need = num_blocks_for(num_tokens, self.block_size) - self.num_blocks_of(req_id)
        return self.allocate(req_id, need) if need > 0 else ()

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
        self._free.extend(reversed(dropped))
        return len(dropped)

    def free(self, req_id: int) -> int:
        """Returns all of the request's blocks to the pool; returns how many."""
        held = self._held.pop(req_id, None)
        if not held:
            return 0
        self._free.extend(reversed(held))
        return len(held)

    def check(self) -> None:
        """Asserts the accounting invariant (used by tests and the simulator)."""
        held_ids = [b for ids in self._held.values() for b in ids]
        all_ids = held_ids + self._free
        if len(all_ids) != self.num_total or len(set(all_ids)) != self.num_total:
            raise AssertionError(
                f"block accounting broken: {len(held_ids)} held + {len(self._free)} free "
                f"!= {self.num_total} or duplicates"
            )
