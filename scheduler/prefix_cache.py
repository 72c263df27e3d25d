"""Automatic prefix caching: full KV blocks found by their content and shared read-only.

A full block's key is a hash of its parent block's key and its token ids; the first block's
parent is the request's cache root, a hash of its isolation scope: its tenant (unless the
operator shares one cache between tenants) and its `cache_salt`. Equal keys mean equal tokens
at equal positions after an equal prefix in the same scope, hence equal KV. A tenant's keys are
never another's, so it never maps, and cannot time, blocks another tenant's prompts made.

At admission a request takes the longest cached prefix of its context, at most
`(context_len - 1) // block_size` blocks, so at least one token is computed and its prefill
starts in a block of its own: no request ever writes into a shared block. Blocks enter the
cache only once every position in them is committed: as prefill chunks complete, and when a
request gives its blocks back (its decoded blocks then serve a later turn or its own recompute
after preemption). Rows past the committed end (rejected drafts) never do.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from hashlib import blake2b

import msgspec
import numpy as np

from scheduler.kv_blocks import BlockPool
from scheduler.request import Request

KEY_BYTES = 16
# A waiting request is held back while a live request is prefilling at least this many tokens
# of its prefix past what is cached (or most of what it would compute, of a shared prefix this
# long): a round's wait for those blocks costs it less than computing them again costs every
# request in the round.
HOLD_MIN_TOKENS = 256
_ROOT_TAG = b"hipfire-prefix-cache/1\0"


def cache_root(tenant: str | None, cache_salt: str | None) -> bytes:
    """The key the chain of a scope starts from (`tenant` None: the shared cache)."""
    scope = msgspec.json.encode([tenant, cache_salt])
    return blake2b(_ROOT_TAG + scope, digest_size=KEY_BYTES).digest()


def chain_keys(parent: bytes, token_ids, block_size: int) -> list[bytes]:
    """Keys of the full blocks of `token_ids`, continuing the chain from `parent`."""
    raw = np.asarray(token_ids, dtype="<i8").tobytes()
    step = block_size * 8
    keys = []
    for start in range(0, len(raw) - step + 1, step):
        parent = blake2b(parent + raw[start : start + step], digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


def context_slice(req: Request, start: int, end: int) -> list[int] | tuple[int, ...]:
    """Tokens `start:end` of the request's context (prompt + outputs), without building it."""
    prompt = req.spec.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    outputs = req.output_token_ids[max(start - num_prompt, 0) : end - num_prompt]
    return list(prompt[start:]) + outputs


@dataclass
class PrefixCacheCounters:
    """Context tokens looked up at admission and those found cached, per tenant; requests
    resumed after preemption count apart (their hits are their own blocks, mostly)."""

    queries: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    hits: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    resumed_queries: int = 0
    resumed_hits: int = 0


class PrefixCache:
    def __init__(self, kv: BlockPool, enabled: bool, shared: bool):
        self.kv = kv
        self.enabled = enabled
        self.shared = shared  # one cache for every tenant (the cache_salt still separates)
        self.counters = PrefixCacheCounters()

    def keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """The request's block keys, at least `num_blocks` of them (computed once, kept on the
        request: its context only grows, and a stop that cuts it drops the keys past it)."""
        keys = req.cache_keys
        if len(keys) < num_blocks:
            spec = req.spec
            parent = (
                keys[-1]
                if keys
                else cache_root(None if self.shared else spec.tenant, spec.cache_salt)
            )
            bs = self.kv.block_size
            keys += chain_keys(parent, context_slice(req, len(keys) * bs, num_blocks * bs), bs)
        return keys

    def hit(self, req: Request) -> list[int]:
        """The cached blocks the request may start from (nothing is taken yet)."""
        if not self.enabled:
            return []
        num = (req.context_len - 1) // self.kv.block_size
        return self.kv.lookup(self.keys(req, num)[:num]) if num > 0 else []

    def in_flight(self, req: Request, hit: list[int], prefilling: list[Request]) -> int:
        """Tokens of `req`'s prefix past its cached `hit` that one of the `prefilling`
        requests is computing now (blocks of its prompt not committed yet): the request finds
        them cached once that prefill commits them."""
        if not self.enabled or not prefilling:
            return 0
        bs = self.kv.block_size
        num = (req.context_len - 1) // bs
        mine = self.keys(req, num)[len(hit) : num]
        if not mine:
            return 0
        best = 0
        for other in prefilling:
            if other.spec.cache_salt != req.spec.cache_salt:
                continue  # another scope: its keys can never match
            end = min(other.num_prefill_target // bs, len(hit) + len(mine))
            if end <= max(other.num_cached_blocks, len(hit)):
                continue
            theirs = self.keys(other, end)
            run = 0
            for i in range(len(hit), end):
                if theirs[i] != mine[i - len(hit)]:
                    break
                run += 1
            # blocks the other request committed already would be in `hit`: what matches
            # past it is in flight
            best = max(best, run)
        return best * bs

    def should_wait(self, req: Request, hit: list[int], prefilling: list[Request]) -> bool:
        """Whether `req` waits for a prefix in flight (HOLD_MIN_TOKENS says when)."""
        in_flight = self.in_flight(req, hit, prefilling)
        if in_flight >= HOLD_MIN_TOKENS:
            return True
        shared = len(hit) * self.kv.block_size + in_flight
        uncached = req.context_len - len(hit) * self.kv.block_size
        return in_flight > 0 and 2 * in_flight >= uncached and shared >= HOLD_MIN_TOKENS

    def attach(self, req: Request, blocks: list[int]) -> None:
        """The request (admitted, holding no blocks) starts with `blocks`: their positions count
        as computed."""
        if blocks:
            self.kv.share(req.req_id, blocks)
        req.num_cached_blocks = len(blocks)
        req.num_computed = req.num_cached_tokens = len(blocks) * self.kv.block_size
        if not self.enabled:
            return
        c = self.counters
        if req.num_preemptions:
            c.resumed_queries += req.context_len
            c.resumed_hits += req.num_computed
        else:
            c.queries[req.spec.tenant] += req.context_len
            c.hits[req.spec.tenant] += req.num_computed

    def commit(self, req: Request, num_tokens: int) -> None:
        """Caches the request's full blocks among its first `num_tokens` positions, whose KV is
        committed, that are not cached yet."""
        num = num_tokens // self.kv.block_size
        first = req.num_cached_blocks
        if num <= first or not self.enabled:
            return
        keys = self.keys(req, num)
        self.kv.register(req.req_id, first, keys[first:num])
        req.num_cached_blocks = num

    def forget_past(self, req: Request, context_len: int) -> None:
        """The request's context was cut to `context_len` tokens: keys past it are stale."""
        del req.cache_keys[context_len // self.kv.block_size :]
