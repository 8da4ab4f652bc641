"""Accelerator profiles: peak dense FLOP/s, memory and links, one TOML data file per device.

Every entry states whether its figures are per card or per die and cites its source. Users add a
profile by dropping a TOML file with the same fields in this folder or in a folder named by
``TREX_HARDWARE_DIR``. On CPU the peak is measured (``trex.device.measure_matmul_flops``).
"""

from __future__ import annotations

import glob
import os
import tomllib
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator. FLOP/s are dense (no sparsity) for the counted unit (card or die)."""

    name: str
    unit: str  # "card" or "die": what one device / one rank is
    peak_tflops: dict[str, float]  # dtype ("bf16", "fp16", "fp8", "fp32") -> dense TFLOP/s
    memory_gib: float
    intra_node_gbps: float  # per-device one-direction bandwidth to peers in the node, GB/s
    inter_node_gbps: float  # per-device network bandwidth across nodes, GB/s
    devices_per_node: int
    match: list[str] = field(default_factory=list)  # substrings of the torch device name
    device_type: str = ""  # the torch device type it appears as (cuda, npu, ...); "" when not stated
    source: str = ""
    host_memory_gib: float = 0.0  # host (CPU) memory per node; 0: not stated (offload is not checked)
    host_link_gbps: float = 0.0  # per-device one-direction host link (PCIe), GB/s; 0: not stated
    memory_gbps: float = 0.0  # device memory (HBM) bandwidth, GB/s; 0: not stated (no device estimate)
    kernel_us: float = 4.0  # the least time a kernel takes, launch gap included, in an eager step (microseconds)

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise KeyError(f"hardware profile {self.name!r} has no peak for {dtype}; has {sorted(self.peak_tflops)}")
        return self.peak_tflops[dtype] * 1e12


def load_profiles() -> dict[str, HardwareProfile]:
    dirs = [os.path.join(_HERE, "profiles")]
    if os.environ.get("TREX_HARDWARE_DIR"):
        dirs.append(os.environ["TREX_HARDWARE_DIR"])
    profiles = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.toml"))):
            with open(path, "rb") as f:
                raw = tomllib.load(f)
            try:
                profile = HardwareProfile(**raw)
            except TypeError as e:
                raise ValueError(f"{path}: invalid hardware profile ({e})") from None
            profiles[profile.name] = profile
    return profiles


def profile_for_device_name(device_name: str) -> HardwareProfile | None:
    """The profile whose ``match`` substrings occur in a device's reported name."""
    for profile in load_profiles().values():
        if any(m.lower() in device_name.lower() for m in profile.match):
            return profile
    return None
