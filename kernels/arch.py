"""Per-architecture launch settings of the kernels, and the check whether they can run at all.

One table (`FAMILY_CONFIGS`) holds every tunable: tile sizes, warps, pipelining stages and the
AMD occupancy hint `waves_per_eu`. Tuning a new GPU means adding or editing one entry here; the
kernels never branch on the device themselves.

Families:
- `hopper`: sm90 (H100, H200). Large tiles: wgmma wants 64-row multiples and 4-warp groups.
  Attention entry chosen by the tile sweep of `kernels.bench --tune` on an H200 (see
  docs/perf/kernels.md): 128-vector tiles of 8 warps capped at 128 registers, so two share an
  SM; programs per SM by tile size read off the compiled binaries' registers and shared memory
  (tests/kernels/attention_sm90_compile.py checks them); lazy rescaling and one-tile-ahead q.k
  off, both slower on most swept shapes.
  Shape rules for the 128-vector tiles (16 rows x GQA 8), all from host-known shapes only
  (`plan_launch` applies them). Stages: split launches, whose grid is one wave of programs,
  take 2 stages and unsplit grids of several waves 3; the sweep of 2026-11-29 21:08 UTC put 2
  stages ahead at batch 16 / 8k (207 against 212 us) and batch 1 / 32k (69 against 71 us) and
  3 ahead at batch 64 / 8k and 32k (750 against 779 us, 2960 against 3035 us). Fill: a grid of
  128-vector programs below half of its slots (batch 1 at 1k: 16 programs for 264 slots; at 8k:
  128) leaves SMs idle that twice as many 64-vector programs use; those shapes took 20.2 and
  30.4 us with 64-vector tiles in the 19:37 record against 23.3 and 36.1 us with 128-vector
  tiles at 21:14, while grids at 97% of the slots (batch 16 at 1k, batch 1 at 32k) were faster
  with 128-vector tiles (49.0 against 59.5 us, 69.1 against 85 us).
  Short contexts (block tables under 4096 tokens: the decode graphs of contexts up to 2k
  with 16-token pages): the sweep of 2026-11-29 23:02 UTC timed batch 16 / 1k / 16 rows at 49.2 us
  with 128-vector tiles in 2 splits (97% of the slots) against 36.1 us with 64-vector tiles
  unsplit, and batch 1 / 1k at 18.8 us (16 rows) and 18.5 us (8 rows) with 2 splits of 512
  tokens against 14.6 and 11.5 us with 8 splits of 128 (64-vector tiles, 3 stages). So below
  `short_ctx_len` the fill rule counts the 128-vector grid without its splits (batch 64 / 1k
  keeps its unsplit 128-vector tiles, 194% of the slots) and splits may be 128 tokens short;
  contexts of 4096 tokens and more plan as before.
  `python -m kernels.bench --sweep` times each rule's choice against the alternatives.
- `ampere_ada`: sm80/86/89. mma.sync tiles, smaller shared memory on the consumer parts.
- `cdna3`: gfx94x (MI300). wave64, 64 KB LDS per CU, MFMA.
- `rdna3`: gfx110x and gfx115x (incl. gfx1151 Strix Halo). wave32 with WMMA, 64 KB LDS.
- `rdna4`: gfx120x (incl. gfx1201, Radeon AI PRO R9700). wave32 with WMMA, 64 KB LDS.
- `default`: anything else (gfx103x has no WMMA, unknown NVIDIA parts, the CPU interpreter):
  small tiles that fit everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionTiles:
    """Verify-attention tiling. A tile is (rows of one sequence) x (GQA group) query vectors.

    Tiles of up to 64 query vectors use `block_n`, `num_warps` and `num_stages` (or
    `num_stages_split` when the KV is split); larger tiles use the `*_large` settings.
    """

    block_n: int  # KV tokens per inner step
    max_block_m: int  # cap on rows_per_tile * group_pad (query vectors per program)
    num_warps: int  # for tiles of up to 64 query vectors
    num_stages: int
    num_stages_split: int  # split launches of tiles of up to 64 query vectors
    block_n_large: int  # for tiles of more than 64 query vectors
    num_warps_large: int
    num_stages_large: int  # larger tiles, unsplit launches
    num_stages_large_split: int  # larger tiles, split launches
    # A grid of larger tiles (tiles x KV heads x splits) that would fill fewer than this percent
    # of its program slots takes tiles of up to 64 query vectors instead (twice the programs,
    # each sequence's rows cut in halves); 0: never.
    min_fill_pct_large: int
    lazy_rescale: int  # 1: rescale the accumulator only when a row's max grows by > 2**8
    pipeline_qk: int  # 1: issue q.k of the next KV tile before this tile's softmax and PV
    max_regs: int  # NVIDIA, tiles of up to 64 query vectors: register cap per thread, 0: none
    max_regs_large: int  # the same for larger tiles (128 lets two 8-warp programs share an SM)
    waves_per_eu: int  # AMD only: occupancy hint, 0 leaves it to the compiler
    min_split_len: int  # fewest KV tokens worth a split of their own
    max_splits: int
    # Block-table capacities (KV tokens) under this count as short contexts; 0: none. There a
    # split costs about what it saves (its partials are written and merged for little KV), so
    # the fallback rule above counts a grid of larger tiles without its splits, and a grid
    # below one wave may split down to `min_split_len_short` tokens.
    short_ctx_len: int
    min_split_len_short: int
    # Programs one SM / CU holds at once, by query vectors per tile, at `num_stages` (the split
    # rule fills these slots): 16, 32, 33..64 and more than 64 (at the `*_large` settings).
    programs_per_sm_m16: int
    programs_per_sm_m32: int
    programs_per_sm: int
    programs_per_sm_large: int


@dataclass(frozen=True)
class ArchConfig:
    family: str
    warp_size: int
    lds_bytes: int  # shared memory (LDS) per block we plan for
    attention: AttentionTiles
    row_warps: int  # norms, RoPE, accept: one program per row
    vocab_chunk: int  # vocabulary entries per program of argmax / top-k
    waves_per_eu: int  # AMD occupancy hint for the row kernels, 0: compiler default


FAMILY_CONFIGS: dict[str, ArchConfig] = {
    "hopper": ArchConfig(
        family="hopper",
        warp_size=32,
        lds_bytes=227 * 1024,
        attention=AttentionTiles(
            block_n=64, max_block_m=128, num_warps=4, num_stages=2,
            num_stages_split=3, block_n_large=64, num_warps_large=8,
            num_stages_large=3, num_stages_large_split=2,
            min_fill_pct_large=50, lazy_rescale=0, pipeline_qk=0, max_regs=0,
            max_regs_large=128, waves_per_eu=0,
            min_split_len=512, max_splits=32, short_ctx_len=4096,
            min_split_len_short=128, programs_per_sm_m16=4, programs_per_sm_m32=3,
            programs_per_sm=2,
            programs_per_sm_large=2,
        ),
        row_warps=8,
        vocab_chunk=4096,
        waves_per_eu=0,
    ),
    "ampere_ada": ArchConfig(
        family="ampere_ada",
        warp_size=32,
        lds_bytes=99 * 1024,
        attention=AttentionTiles(
            block_n=64, max_block_m=128, num_warps=4, num_stages=2,
            num_stages_split=2, block_n_large=64, num_warps_large=8,
            num_stages_large=2, num_stages_large_split=2,
            min_fill_pct_large=0, lazy_rescale=0, pipeline_qk=0, max_regs=0,
            max_regs_large=0, waves_per_eu=0,
            min_split_len=512, max_splits=32, short_ctx_len=0,
            min_split_len_short=512, programs_per_sm_m16=4, programs_per_sm_m32=4,
            programs_per_sm=4,
            programs_per_sm_large=2,
        ),
        row_warps=8,
        vocab_chunk=4096,
        waves_per_eu=0,
    ),
    "cdna3": ArchConfig(
        family="cdna3",
        warp_size=64,
        lds_bytes=64 * 1024,
        attention=AttentionTiles(
            block_n=64, max_block_m=128, num_warps=4, num_stages=1,
            num_stages_split=1, block_n_large=64, num_warps_large=8,
            num_stages_large=1, num_stages_large_split=1,
            min_fill_pct_large=0, lazy_rescale=0, pipeline_qk=0, max_regs=0,
            max_regs_large=0, waves_per_eu=2,
            min_split_len=512, max_splits=32, short_ctx_len=0,
            min_split_len_short=512, programs_per_sm_m16=4, programs_per_sm_m32=4,
            programs_per_sm=4,
            programs_per_sm_large=2,
        ),
        row_warps=8,
        vocab_chunk=4096,
        waves_per_eu=0,
    ),
    "rdna3": ArchConfig(
        family="rdna3",
        warp_size=32,
        lds_bytes=64 * 1024,
        attention=AttentionTiles(
            block_n=32, max_block_m=64, num_warps=4, num_stages=1,
            num_stages_split=1, block_n_large=32, num_warps_large=4,
            num_stages_large=1, num_stages_large_split=1,
            min_fill_pct_large=0, lazy_rescale=0, pipeline_qk=0, max_regs=0,
            max_regs_large=0, waves_per_eu=2,
            min_split_len=256, max_splits=16, short_ctx_len=0,
            min_split_len_short=256, programs_per_sm_m16=4, programs_per_sm_m32=4,
            programs_per_sm=4,
            programs_per_sm_large=2,
        ),
        row_warps=4,
        vocab_chunk=2048,
        waves_per_eu=0,
    ),
    "rdna4": ArchConfig(
        family="rdna4",
        warp_size=32,
        lds_bytes=64 * 1024,
        attention=AttentionTiles(
            block_n=32, max_block_m=64, num_warps=4, num_stages=1,
            num_stages_split=1, block_n_large=32, num_warps_large=4,
            num_stages_large=1, num_stages_large_split=1,
            min_fill_pct_large=0, lazy_rescale=0, pipeline_qk=0, max_regs=0,
            max_regs_large=0, waves_per_eu=2,
            min_split_len=256, max_splits=16, short_ctx_len=0,
            min_split_len_short=256, programs_per_sm_m16=4, programs_per_sm_m32=4,
            programs_per_sm=4,
            programs_per_sm_large=2,
        ),
        row_warps=4,
        vocab_chunk=2048,
        waves_per_eu=0,
    ),
    "default": ArchConfig(
        family="default",
        warp_size=32,
        lds_bytes=48 * 1024,
        attention=AttentionTiles(
            block_n=32, max_block_m=64, num_warps=4, num_stages=1,
            num_stages_split=1, block_n_large=32, num_warps_large=4,
            num_stages_large=1, num_stages_large_split=1,
            min_fill_pct_large=0, lazy_rescale=0, pipeline_qk=0, max_regs=0,
            max_regs_large=0, waves_per_eu=0,
            min_split_len=256, max_splits=16, short_ctx_len=0,
            min_split_len_short=256, programs_per_sm_m16=2, programs_per_sm_m32=2,
            programs_per_sm=2,
            programs_per_sm_large=1,
        ),
        row_warps=4,
        vocab_chunk=2048,
        waves_per_eu=0,
    ),
}

# gfx11 and gfx12 have WMMA; gfx103x (RDNA2) does not and must not be taken for RDNA3.
_RDNA3 = re.compile(r"^gfx11(0[0-3]|5[0-3])$")
_RDNA4 = re.compile(r"^gfx120[01]$")
_CDNA3 = re.compile(r"^gfx94[0-2]$|^gfx950$")


def family_of_amd_arch(gcn_arch: str) -> str:
    """Maps a gcnArchName such as 'gfx1151' or 'gfx942:sramecc+:xnack-' to a family."""
    name = gcn_arch.split(":")[0].strip().lower()
    if _CDNA3.match(name):
        return "cdna3"
    if _RDNA3.match(name):
        return "rdna3"
    if _RDNA4.match(name):
        return "rdna4"
    return "default"


def family_of_cuda_capability(major: int, minor: int) -> str:
    if major == 9 and minor == 0:
        return "hopper"
    if major == 8:
        return "ampere_ada"
    return "default"


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_hip() -> bool:
    return torch.version.hip is not None


@functools.lru_cache(maxsize=16)
def _config_for(device_type: str, index: int) -> tuple[ArchConfig, int]:
    if device_type != "cuda":
        return FAMILY_CONFIGS["default"], 4
    props = torch.cuda.get_device_properties(index)
    if is_hip():
        family = family_of_amd_arch(getattr(props, "gcnArchName", ""))
    else:
        family = family_of_cuda_capability(props.major, props.minor)
    return FAMILY_CONFIGS[family], props.multi_processor_count


def arch_config(device: torch.device) -> ArchConfig:
    """The table entry for `device` (the `default` entry for the CPU interpreter)."""
    index = device.index if device.index is not None else 0
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device()
    return _config_for(device.type, index)[0]


def num_compute_units(device: torch.device) -> int:
    """SMs (NVIDIA) or CUs (AMD); a small fixed number on the CPU interpreter."""
    index = device.index if device.index is not None else 0
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device()
    return _config_for(device.type, index)[1]


def launch_options(device: torch.device, waves_per_eu: int, max_regs: int = 0) -> dict:
    """Extra launch keywords: `waves_per_eu` exists only for the AMD backend, the register
    cap (`maxnreg`) only for NVIDIA's."""
    if device.type != "cuda" or is_interpreter():
        return {}
    if is_hip():
        return {"waves_per_eu": waves_per_eu} if waves_per_eu > 0 else {}
    return {"maxnreg": max_regs} if max_regs > 0 else {}


def kernels_available(device: torch.device | str) -> bool:
    """True where the Triton kernels run natively: a CUDA or ROCm device with Triton installed.

    The CPU (with or without TRITON_INTERPRET) answers False: the executor takes the pure-torch
    references there, the interpreter being for tests only.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Programmatic dependent launch (PDL, sm90+): a kernel launched with it may start while the
# kernel before it on the stream finishes; it waits (`gdc_wait`) before touching anything an
# earlier kernel writes or reads, and lets the next one launch (`gdc_launch_dependents`). The
# kernels of the decode forward take a `USE_PDL` constexpr and the wrappers pass it together
# with the `launch_pdl` launch keyword (`pdl_options`). HIPFIRE_PDL=0 turns it off; it is read
# once per process, so every compiled variant has one value of the constexpr and start-up
# compiles what serving launches. `pdl_forced` changes it inside a process (tests, benchmarks):
# launches and graph captures made under it keep the value they were made with.
PDL_ENV = "HIPFIRE_PDL"
_pdl_override: list[bool | None] = [None]


@functools.lru_cache(maxsize=1)
def _pdl_env_allows() -> bool:
    return os.environ.get(PDL_ENV, "1") != "0"


@functools.lru_cache(maxsize=1)
def triton_has_pdl() -> bool:
    """Whether this Triton has the grid dependency control functions and the `launch_pdl`
    launch option (Triton 3.4 and later); without them PDL stays off."""
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    has_gdc = all(hasattr(cuda, f) for f in ("gdc_wait", "gdc_launch_dependents"))
    return has_gdc and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=16)
def _pdl_capable(device_type: str, index: int) -> bool:
    if device_type != "cuda" or is_interpreter() or is_hip() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9 and triton_has_pdl()


def pdl_capable(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9 or more, natively (never the interpreter or AMD),
    with a Triton that can launch with PDL."""
    index = device.index if device.index is not None else 0
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device()
    return _pdl_capable(device.type, index)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` now use PDL: capable, and neither HIPFIRE_PDL=0
    nor `pdl_forced(False)` says otherwise."""
    if device.type != "cuda":
        return False
    override = _pdl_override[0]
    wanted = _pdl_env_allows() if override is None else override
    return wanted and pdl_capable(device)


@contextlib.contextmanager
def pdl_forced(enabled: bool):
    """PDL on (where capable) or off for the launches and captures made inside the block."""
    saved = _pdl_override[0]
    _pdl_override[0] = enabled
    try:
        yield
    finally:
        _pdl_override[0] = saved


def pdl_options(device: torch.device) -> dict:
    """The keywords a PDL-aware kernel launch takes: its `USE_PDL` constexpr and, when on, the
    `launch_pdl` launch option (the two always together)."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
