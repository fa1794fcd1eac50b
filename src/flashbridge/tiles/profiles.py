"""What the resource model needs to know about a GPU: one :class:`GPUProfile` per device kind.

The figures are the vendors' published limits (CUDA occupancy tables, the ROCm CDNA3 ISA guide, data
sheets): shared memory per SM and per block (the opt-in maximum a kernel may request), registers per SM and
per thread, resident threads / warps / blocks per SM, HBM bandwidth, dense 16-bit tensor throughput (no
sparsity) and L2. :func:`profile_of` reads a live device through Triton's driver when there is one and
completes it from the named profile of the same kind.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

KB = 1024


@dataclasses.dataclass(frozen=True)
class GPUProfile:
    """One GPU kind's limits. Shared memory and registers are per SM (NVIDIA) or per CU (AMD); a "warp"
    is ``warp_size`` threads (a wavefront of 64 on AMD)."""

    name: str
    arch: str  # "sm_90", "gfx942", ...
    capability: int  # CUDA compute capability as 90; AMD: the gfx number (942)
    sms: int
    smem_per_sm: int  # bytes
    smem_per_block: int  # bytes, the opt-in maximum of one block
    smem_reserved_per_block: int  # bytes the driver keeps per resident block (1 KB on sm_80+)
    regs_per_sm: int  # 32-bit registers
    max_regs_per_thread: int
    reg_alloc_unit: int  # registers are allocated per warp in units of this many per thread
    max_threads_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    warp_size: int
    hbm_tb_s: float
    bf16_tflops: float  # dense tensor-core bf16 with float32 accumulation
    l2_bytes: int
    wgmma: bool = False  # asynchronous warpgroup MMAs (Hopper): operand B (and A) read from shared memory
    vendor: str = "nvidia"
    note: str = ""

    @property
    def ridge(self) -> float:
        """FLOP per HBM byte at which a kernel turns from memory- to compute-bound."""
        return self.bf16_tflops * 1e12 / (self.hbm_tb_s * 1e12)

    def summary(self) -> str:
        return (f"{self.name} ({self.arch}): {self.sms} SMs, {self.smem_per_block // KB} KB shared memory per "
                f"block ({self.smem_per_sm // KB} KB per SM), {self.regs_per_sm // 1024}K registers per SM "
                f"(<= {self.max_regs_per_thread} per thread), {self.max_warps_per_sm} warps per SM, "
                f"{self.hbm_tb_s:g} TB/s, {self.bf16_tflops:g} bf16 TFLOP/s, L2 {self.l2_bytes // 2**20} MB")


_HOPPER = dict(arch="sm_90", capability=90, smem_per_sm=228 * KB, smem_per_block=227 * KB,
               smem_reserved_per_block=KB, regs_per_sm=65536, max_regs_per_thread=255, reg_alloc_unit=8,
               max_threads_per_sm=2048, max_warps_per_sm=64, max_blocks_per_sm=32, warp_size=32, wgmma=True)
_ADA = dict(arch="sm_89", capability=89, smem_per_sm=100 * KB, smem_per_block=99 * KB,
            smem_reserved_per_block=KB, regs_per_sm=65536, max_regs_per_thread=255, reg_alloc_unit=8,
            max_threads_per_sm=1536, max_warps_per_sm=48, max_blocks_per_sm=24, warp_size=32)

PROFILES: dict[str, GPUProfile] = {p.name: p for p in (
    GPUProfile("A100", arch="sm_80", capability=80, sms=108, smem_per_sm=164 * KB, smem_per_block=163 * KB,
               smem_reserved_per_block=KB, regs_per_sm=65536, max_regs_per_thread=255, reg_alloc_unit=8,
               max_threads_per_sm=2048, max_warps_per_sm=64, max_blocks_per_sm=32, warp_size=32,
               hbm_tb_s=2.039, bf16_tflops=312, l2_bytes=40 * 2**20, note="SXM4 80 GB"),
    GPUProfile("H100", sms=132, hbm_tb_s=3.35, bf16_tflops=989, l2_bytes=50 * 2**20, note="SXM5 80 GB",
               **_HOPPER),
    GPUProfile("H200", sms=132, hbm_tb_s=4.8, bf16_tflops=989, l2_bytes=50 * 2**20, note="SXM 141 GB HBM3e",
               **_HOPPER),
    GPUProfile("L40S", sms=142, hbm_tb_s=0.864, bf16_tflops=362, l2_bytes=96 * 2**20, note="GDDR6 48 GB", **_ADA),
    GPUProfile("RTX 4090", sms=128, hbm_tb_s=1.008, bf16_tflops=165, l2_bytes=72 * 2**20,
               note="GDDR6X 24 GB; bf16 with float32 accumulation runs at half the fp16-accumulate rate", **_ADA),
    GPUProfile("B200", arch="sm_100", capability=100, sms=148, smem_per_sm=228 * KB, smem_per_block=227 * KB,
               smem_reserved_per_block=KB, regs_per_sm=65536, max_regs_per_thread=255, reg_alloc_unit=8,
               max_threads_per_sm=2048, max_warps_per_sm=64, max_blocks_per_sm=32, warp_size=32,
               hbm_tb_s=8.0, bf16_tflops=2250, l2_bytes=126 * 2**20, wgmma=True,
               note="HBM3e 180 GB; tcgen05 MMAs accumulate in 256 KB of tensor memory per SM, which this model "
                    "does not count (it counts accumulators in registers, as on Hopper)"),
    GPUProfile("MI300X", arch="gfx942", capability=942, sms=304, smem_per_sm=64 * KB, smem_per_block=64 * KB,
               smem_reserved_per_block=0, regs_per_sm=4 * 512 * 64, max_regs_per_thread=512, reg_alloc_unit=8,
               max_threads_per_sm=2048, max_warps_per_sm=32, max_blocks_per_sm=32, warp_size=64,
               hbm_tb_s=5.3, bf16_tflops=1307, l2_bytes=32 * 2**20, vendor="amd",
               note="304 CUs; LDS 64 KB per CU; 512 VGPRs (+AGPRs) per lane; 4 MB L2 per XCD plus 256 MB "
                    "Infinity Cache"),
)}

_ALIASES = {"h100 sxm": "H100", "h100sxm": "H100", "h100": "H100", "h200": "H200", "a100": "A100",
            "l40s": "L40S", "rtx4090": "RTX 4090", "4090": "RTX 4090", "geforce rtx 4090": "RTX 4090",
            "b200": "B200", "mi300x": "MI300X", "mi300": "MI300X"}


def profile(name: str) -> GPUProfile:
    """The named profile (case and spaces ignored: "h200", "RTX4090", "NVIDIA H100 80GB HBM3" all work);
    a ValueError listing the known names otherwise."""
    found = _match(name)
    if found is None:
        raise ValueError(f"gpu: unknown GPU {name!r}; known profiles: {', '.join(PROFILES)}")
    return found


def _match(name: str) -> Optional[GPUProfile]:
    key = re.sub(r"\s+", " ", name.strip().lower().replace("nvidia", "").replace("amd", "")
                 .replace("instinct", "")).strip()
    if key in _ALIASES:
        return PROFILES[_ALIASES[key]]
    compact = key.replace(" ", "")
    for alias in sorted(_ALIASES, key=len, reverse=True):  # "H100 80GB HBM3" -> H100, longest alias first
        if alias.replace(" ", "") in compact:
            return PROFILES[_ALIASES[alias]]
    return None


def profile_named(name: str, sms: int) -> GPUProfile:
    """The profile of a device known only by name and SM count (JAX's ``device_kind``): the named profile
    with that SM count, else an H100-like profile under the device's own name (the tuning cache keys on it;
    the resource model's choices for it assume Hopper limits)."""
    known = _match(name) if name else None
    if known is not None:
        return known if known.sms == sms else dataclasses.replace(known, sms=sms)
    return dataclasses.replace(PROFILES["H100"], name=name or "unknown GPU", sms=sms,
                               note="unknown device: limits assumed as an H100's")


def device_name(device: int = 0) -> Optional[str]:
    """The name of CUDA / ROCm device ``device`` (through torch when it is installed), or None without one."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(device)
    except ImportError:
        pass
    return None


def profile_of(device: Optional[int] = 0) -> Optional[GPUProfile]:
    """The live GPU's profile: its SM count, shared memory and register limits as the driver reports them,
    with bandwidth and throughput from the named profile of the same kind (from the memory clock and bus
    width where the kind is unknown). None when there is no GPU."""
    name = device_name(device or 0)
    if name is None:
        return None
    known = _match(name)
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(device or 0)
    except Exception:  # noqa: BLE001 - no Triton driver for this device: the named profile, if any
        props = None
    if props is None:
        return known
    base = known or PROFILES["H100"]
    bandwidth = base.hbm_tb_s
    if known is None and props.get("mem_clock_rate") and props.get("mem_bus_width"):
        bandwidth = 2 * props["mem_clock_rate"] * 1e3 * props["mem_bus_width"] / 8 / 1e12
    capability = base.capability
    try:
        import torch

        major, minor = torch.cuda.get_device_capability(device or 0)
        capability = 10 * major + minor
    except Exception:  # noqa: BLE001 - ROCm / no torch: the named profile's
        pass
    return dataclasses.replace(
        base, name=name if known is None else known.name, capability=capability,
        arch=base.arch if known else f"sm_{capability}",
        sms=props.get("multiprocessor_count", base.sms),
        smem_per_block=props.get("max_shared_mem", base.smem_per_block),
        max_regs_per_thread=min(base.max_regs_per_thread, props.get("max_num_regs", base.regs_per_sm)),
        warp_size=props.get("warpSize", base.warp_size), hbm_tb_s=bandwidth,
        note=base.note if known else f"read from the device; throughput assumed as {base.name}'s")
