"""Tile rules of verify attention: the launch of a call from host-known shapes and the arch table.

`plan_launch` is the one place that reads the attention tiles of `kernels.arch`; it sees only
shapes the host knows without a device sync, so a captured graph replays the launch it was
captured with. `reachable_variants` enumerates the compiled variants the rules can pick for a
model's bounds, so start-up can compile them all (`kernels.attention.compile_variants`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.arch import arch_config, num_compute_units


@dataclass(frozen=True)
class AttentionLaunch:
    """Tiling of one verify-attention call, from shapes and the arch table only."""

    rows_per_tile: int
    block_m: int  # query vectors per program (rows_per_tile x padded group, >= 16)
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    num_tiles: int  # grid axis 0
    lazy_rescale: bool
    pipeline_qk: bool
    max_regs: int  # 0: the compiler's choice


# Width of the kernel's sequence search: one padded width up to 255 sequences per round.
_MIN_SEQS_PAD = 256
# Width of the merge kernel's split vector: one padded width up to 32 splits.
_MIN_SPLITS_PAD = 32


def splits_pad(num_splits: int) -> int:
    """The merge kernel's split-vector width (a constexpr): the split count itself is a
    runtime argument, so a changing count compiles nothing new."""
    return max(_MIN_SPLITS_PAD, next_pow2(num_splits))


def seqs_pad(num_seqs: int) -> int:
    """The kernel's sequence-search width for a round of `num_seqs` sequences (a constexpr)."""
    return max(_MIN_SEQS_PAD, next_pow2(num_seqs + 1))


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def choose_rows_per_tile(max_block_m: int, group: int, rows_hint: int) -> int:
    """Rows of one sequence per program: all of them up to `max_block_m` query vectors.

    A tile never spans sequences, so rows beyond `rows_hint` (the deepest sequence) would only
    be padding. Past the cap a sequence takes several tiles (16 rows x GQA 8 under a 64-vector
    cap: two 8-row tiles); they sit next to each other in the grid, so they run at the same time
    and the second read of the shared KV mostly hits L2.
    """
    rows_cap = max(1, max_block_m // next_pow2(group))
    return min(next_pow2(max(1, rows_hint)), next_pow2(rows_cap))


def programs_per_sm(device: torch.device, block_m: int) -> int:
    """Programs of `block_m` query vectors one SM holds at once (the arch table's figure)."""
    tiles = arch_config(device).attention
    if block_m <= 16:
        return tiles.programs_per_sm_m16
    if block_m <= 32:
        return tiles.programs_per_sm_m32
    return tiles.programs_per_sm if block_m <= 64 else tiles.programs_per_sm_large


def split_slots(device: torch.device, block_m: int) -> int:
    """Program slots of the whole GPU for tiles of `block_m` query vectors."""
    return programs_per_sm(device, block_m) * num_compute_units(device)


def choose_num_splits(
    device: torch.device,
    num_tiles: int,
    num_kv_heads: int,
    max_kv_len: int,
    *,
    block_m: int = 64,
) -> int:
    """Splits so that tiles x heads x splits fills the GPU's program slots, from shapes only.

    The count rounds down: one program past a full wave costs a second wave of the same
    length. `max_kv_len` is the block table's capacity, an upper bound of every sequence's
    length; a split is worth launching only for `min_split_len` tokens or more, or
    `min_split_len_short` at short contexts (where few long splits leave slots idle).
    """
    tiles = arch_config(device).attention
    programs = max(1, num_tiles * num_kv_heads)
    want = split_slots(device, block_m) // programs
    short = max_kv_len < tiles.short_ctx_len
    worth = max(1, max_kv_len // (tiles.min_split_len_short if short else tiles.min_split_len))
    return max(1, min(want, worth, tiles.max_splits))


def fallback_fill_pct(
    device: torch.device, block_m: int, programs: int, num_splits: int, max_kv_len: int
) -> float:
    """Percent of the program slots a grid of `programs` per split x `num_splits` fills, as the
    fallback rule counts it: without its splits at short contexts (under `short_ctx_len`
    tokens), where a split's partials and merge cost about what the extra programs save."""
    tiles = arch_config(device).attention
    counted_splits = num_splits if max_kv_len >= tiles.short_ctx_len else 1
    return 100 * programs * counted_splits / split_slots(device, block_m)


def _tile_grid(
    device: torch.device,
    *,
    rows_per_tile: int,
    group: int,
    num_rows: int,
    num_seqs: int,
    num_kv_heads: int,
    max_kv_len: int,
    num_splits: int | None,
) -> tuple[int, int, int]:
    """(block_m, programs per split, num_splits) of tiles of `rows_per_tile` rows; programs per
    split is tiles x KV heads, splits the given count or the one that fills the slots."""
    block_m = max(16, next_pow2(rows_per_tile * next_pow2(group)))  # tl.dot needs M >= 16
    # Sequences of fewer rows than a tile still take a tile each.
    est_tiles = max(triton.cdiv(num_rows, rows_per_tile), min(num_seqs, num_rows))
    if num_splits is None:
        num_splits = choose_num_splits(device, est_tiles, num_kv_heads, max_kv_len, block_m=block_m)
    assert num_splits >= 1
    return block_m, max(1, est_tiles * num_kv_heads), num_splits


def plan_launch(
    device: torch.device,
    *,
    num_rows: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_kv_len: int,
    max_q_len: int | None = None,
    rows_per_tile: int | None = None,
    num_splits: int | None = None,
    head_dim: int = 128,
) -> AttentionLaunch:
    """Tile, splits, warps and stages for a call (see `verify_attention` for the arguments):
    the one place that reads the arch table's tiles, from host-known shapes only (so a captured
    graph replays the launch it was captured with).

    - Rows per tile: all of a sequence's rows up to `max_block_m` query vectors. A tile of more
      than 64 vectors whose grid (tiles x KV heads x splits; without the splits at contexts
      under `short_ctx_len`) would fill less than `min_fill_pct_large` percent of its program
      slots falls back to tiles of up to 64 vectors: twice the programs keep more SMs busy than
      one read of the KV per sequence saves. A `rows_per_tile` the caller gives is kept.
    - Splits: as many as fill one wave of program slots, each at least `min_split_len` KV
      tokens long (`min_split_len_short` at contexts under `short_ctx_len`), see
      `choose_num_splits`; a `num_splits` the caller gives is kept.
    - Stages: tiles of more than 64 vectors take `num_stages_large_split` in split launches (one
      wave of programs) and `num_stages_large` otherwise. A split launch of smaller tiles takes
      `num_stages_split` when its split count was capped (by `max_splits` or by the context
      length) below the count that fills the program slots: such a grid leaves slots free
      (batch 1 at long context), so a deeper pipeline per program pays off, while a grid that
      fills the slots keeps the stage count they were counted at.
    - Registers: the table's per-thread caps hold for heads of up to 128 dims; a wider head's
      accumulators do not fit them (ptxas refuses), so the compiler chooses.
    """
    tiles = arch_config(device).attention
    group = num_q_heads // num_kv_heads
    shape = {
        "group": group,
        "num_rows": num_rows,
        "num_seqs": num_seqs,
        "num_kv_heads": num_kv_heads,
        "max_kv_len": max_kv_len,
        "num_splits": num_splits,
    }
    if rows_per_tile is None:
        rows_hint = max_q_len if max_q_len is not None else triton.cdiv(num_rows, max(1, num_seqs))
        rows_per_tile = choose_rows_per_tile(tiles.max_block_m, group, rows_hint)
        block_m, programs, splits = _tile_grid(device, rows_per_tile=rows_per_tile, **shape)
        fill_pct = fallback_fill_pct(device, block_m, programs, splits, max_kv_len)
        if block_m > 64 and fill_pct < tiles.min_fill_pct_large:
            rows_per_tile = choose_rows_per_tile(min(64, tiles.max_block_m), group, rows_hint)
    assert rows_per_tile >= 1
    block_m, programs, num_splits = _tile_grid(device, rows_per_tile=rows_per_tile, **shape)
    large = block_m > 64
    if large:
        block_n, num_warps = tiles.block_n_large, tiles.num_warps_large
        num_stages = tiles.num_stages_large_split if num_splits > 1 else tiles.num_stages_large
    else:
        block_n, num_warps, num_stages = tiles.block_n, tiles.num_warps, tiles.num_stages
        if 1 < num_splits < split_slots(device, block_m) // programs:
            num_stages = tiles.num_stages_split
    return AttentionLaunch(
        rows_per_tile=rows_per_tile,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_splits=num_splits,
        num_tiles=triton.cdiv(num_rows, rows_per_tile) + num_seqs,
        lazy_rescale=bool(tiles.lazy_rescale),
        pipeline_qk=bool(tiles.pipeline_qk),
        max_regs=(tiles.max_regs_large if large else tiles.max_regs) if head_dim <= 128 else 0,
    )


def variant_key(launch: AttentionLaunch, num_seqs: int) -> tuple:
    """What selects a compiled kernel among one model's launches (its heads, head size, page
    size and dtype fixed): the tiling's compile-time values. Split counts, sequence and row
    counts are runtime arguments."""
    return (
        launch.rows_per_tile,
        launch.block_m,
        launch.block_n,
        launch.num_warps,
        launch.num_stages,
        launch.num_splits > 1,
        launch.max_regs,
        launch.lazy_rescale,
        launch.pipeline_qk,
        seqs_pad(num_seqs),
    )


def reachable_variants(
    device: torch.device,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    max_seqs: int,
    max_q_len: int,
    max_kv_len: int,
    head_dim: int = 128,
) -> dict[tuple, tuple[AttentionLaunch, int]]:
    """Every compiled variant `plan_launch` can pick for rounds of up to `max_seqs` sequences
    with up to `max_q_len` rows each (uniform groups, and one long group beside single rows)
    over block tables of up to `max_kv_len` tokens: {variant key: (a launch, its num_seqs)}."""

    def powers(limit: int) -> list[int]:
        return sorted({1 << i for i in range(limit.bit_length()) if 1 << i <= limit} | {limit})

    found: dict[tuple, tuple[AttentionLaunch, int]] = {}
    for num_seqs in powers(max_seqs):
        for q_len in powers(max_q_len):
            for num_rows in {num_seqs * q_len, num_seqs - 1 + q_len}:
                for kv_len in _kv_lens(page_size, max_kv_len):
                    if kv_len < q_len:
                        continue
                    launch = plan_launch(
                        device,
                        num_rows=num_rows,
                        num_seqs=num_seqs,
                        num_q_heads=num_q_heads,
                        num_kv_heads=num_kv_heads,
                        max_kv_len=kv_len,
                        max_q_len=q_len,
                        head_dim=head_dim,
                    )
                    found.setdefault(variant_key(launch, num_seqs), (launch, num_seqs))
    return found


def _kv_lens(page_size: int, max_kv_len: int) -> list[int]:
    """Block-table capacities to plan over: every page up to 8k tokens (where the tile rules'
    thresholds sit), then every 256 tokens."""
    dense = list(range(page_size, min(max_kv_len, 8192) + 1, page_size))
    coarse = list(range(dense[-1] + 256, max_kv_len + 1, 256)) if dense else []
    return dense + coarse + ([max_kv_len] if max_kv_len not in dense + coarse else [])
