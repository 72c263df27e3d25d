"""Per-architecture launch settings of the kernels, and the check whether they can run at all.

One table (`FAMILY_CONFIGS`) holds every tunable: tile sizes, warps, pipelining stages and the
AMD occupancy hint `waves_per_eu`. Tuning a new GPU means adding or editing one entry here; the
kernels never branch on the device themselves. The field defaults are the `default` entry (small
tiles that fit everywhere); every other entry states only what differs, and why, beside it.
Families: `hopper` sm90 (H100, H200); `ampere_ada` sm80/86/89; `cdna3` gfx94x and gfx950
(MI300); `rdna3` gfx110x and gfx115x (incl. gfx1151 Strix Halo); `rdna4` gfx120x (incl. gfx1201,
Radeon AI PRO R9700); `default` anything else (gfx103x has no WMMA, unknown NVIDIA parts, the
CPU interpreter). The timings behind the Hopper entry are in docs/perf/kernels.md;
`hipfire-bench kernels --sweep` times each tile rule's choice against the alternatives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class AttentionTiles:
    """Verify-attention tiling. A tile is (rows of one sequence) x (GQA group) query vectors.

    Tiles of up to 64 query vectors use `block_n`, `num_warps` and `num_stages` (or
    `num_stages_split` when the KV is split); larger tiles use the `*_large` settings.
    """

    block_n: int = 32  # KV tokens per inner step
    max_block_m: int = 64  # cap on rows_per_tile * group_pad (query vectors per program)
    num_warps: int = 4  # for tiles of up to 64 query vectors
    num_stages: int = 1
    num_stages_split: int = 1  # split launches of tiles of up to 64 query vectors
    block_n_large: int = 32  # for tiles of more than 64 query vectors
    num_warps_large: int = 4
    num_stages_large: int = 1  # larger tiles, unsplit launches
    num_stages_large_split: int = 1  # larger tiles, split launches
    # A grid of larger tiles (tiles x KV heads x splits) that would fill fewer than this percent
    # of its program slots takes tiles of up to 64 query vectors instead (twice the programs,
    # each sequence's rows cut in halves); 0: never.
    min_fill_pct_large: int = 0
    lazy_rescale: int = 0  # 1: rescale the accumulator only when a row's max grows by > 2**8
    pipeline_qk: int = 0  # 1: issue q.k of the next KV tile before this tile's softmax and PV
    max_regs: int = 0  # NVIDIA, tiles of up to 64 query vectors: register cap per thread, 0: none
    max_regs_large: int = 0  # the same for larger tiles (128 lets two 8-warp programs share an SM)
    waves_per_eu: int = 0  # AMD only: occupancy hint, 0 leaves it to the compiler
    min_split_len: int = 256  # fewest KV tokens worth a split of their own
    max_splits: int = 16
    # Block-table capacities (KV tokens) under this count as short contexts; 0: none. There a
    # split costs about what it saves (its partials are written and merged for little KV), so
    # the fallback rule above counts a grid of larger tiles without its splits, and a grid
    # below one wave may split down to `min_split_len_short` tokens.
    short_ctx_len: int = 0
    min_split_len_short: int = 256
    # Programs one SM / CU holds at once, by query vectors per tile, at `num_stages` (the split
    # rule fills these slots): 16, 32, 33..64 and more than 64 (at the `*_large` settings).
    programs_per_sm_m16: int = 2
    programs_per_sm_m32: int = 2
    programs_per_sm: int = 2
    programs_per_sm_large: int = 1


@dataclass(frozen=True)
class ArchConfig:
    family: str
    warp_size: int = 32
    lds_bytes: int = 48 * 1024  # shared memory (LDS) per block we plan for
    attention: AttentionTiles = field(default_factory=AttentionTiles)
    row_warps: int = 4  # norms, RoPE, accept: one program per row
    vocab_chunk: int = 2048  # vocabulary entries per program of argmax / top-k
    waves_per_eu: int = 0  # AMD occupancy hint for the row kernels, 0: compiler default


# GPUs with matrix units and 64 KB or more of shared memory per SM / CU hold four programs of up
# to 64 query vectors (two larger ones) at once.
_FOUR_PER_SM = AttentionTiles(
    programs_per_sm_m16=4, programs_per_sm_m32=4, programs_per_sm=4, programs_per_sm_large=2,
)
# The data-centre parts: 64 KV tokens per step, tiles of up to 128 query vectors in 8 warps,
# splits of at least 512 tokens, up to 32 of them.
_LARGE_TILES = replace(
    _FOUR_PER_SM, block_n=64, max_block_m=128, block_n_large=64, num_warps_large=8,
    min_split_len=512, min_split_len_short=512, max_splits=32,
)
_LARGE_ROWS = {"row_warps": 8, "vocab_chunk": 4096}  # row kernels of the same parts

FAMILY_CONFIGS: dict[str, ArchConfig] = {
    # wgmma wants 64-row multiples and 4-warp groups. 128-vector tiles of 8 warps are capped at
    # 128 registers so that two share an SM; the programs per SM by tile size follow from the
    # compiled binaries' registers and shared memory (tests/kernels/attention_sm90_compile.py
    # checks them). Lazy rescaling and one-tile-ahead q.k stay off: both lose on most shapes of
    # the tile sweep. 128-vector tiles take 2 stages in split launches, whose grid is one wave
    # of programs, and 3 in unsplit grids of several waves. A 128-vector grid below half of its
    # slots falls back to 64-vector tiles, whose twice as many programs keep more SMs busy than
    # one read of the KV per sequence saves. Block tables under 4096 tokens (the decode graphs
    # of contexts up to 2k with 16-token pages) count as short: the fill rule counts the grid
    # without its splits there, and splits may be 128 tokens short.
    "hopper": ArchConfig(
        family="hopper",
        lds_bytes=227 * 1024,
        attention=replace(
            _LARGE_TILES, num_stages=2, num_stages_split=3, num_stages_large=3,
            num_stages_large_split=2, min_fill_pct_large=50, max_regs_large=128,
            short_ctx_len=4096, min_split_len_short=128, programs_per_sm_m32=3,
            programs_per_sm=2,
        ),
        **_LARGE_ROWS,
    ),
    # mma.sync tiles; smaller shared memory on the consumer parts.
    "ampere_ada": ArchConfig(
        family="ampere_ada",
        lds_bytes=99 * 1024,
        attention=replace(
            _LARGE_TILES, num_stages=2, num_stages_split=2, num_stages_large=2,
            num_stages_large_split=2,
        ),
        **_LARGE_ROWS,
    ),
    # wave64, 64 KB LDS per CU, MFMA.
    "cdna3": ArchConfig(
        family="cdna3",
        warp_size=64,
        lds_bytes=64 * 1024,
        attention=replace(_LARGE_TILES, waves_per_eu=2),
        **_LARGE_ROWS,
    ),
    # wave32 with WMMA, 64 KB LDS.
    "rdna3": ArchConfig(
        family="rdna3", lds_bytes=64 * 1024, attention=replace(_FOUR_PER_SM, waves_per_eu=2)
    ),
    "rdna4": ArchConfig(
        family="rdna4", lds_bytes=64 * 1024, attention=replace(_FOUR_PER_SM, waves_per_eu=2)
    ),
    "default": ArchConfig(family="default"),
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
