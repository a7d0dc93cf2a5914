"""Cost model: estimated time of a kernel from HBM bytes, FLOPs and launch overhead.

    host(kernel)   = launch_overhead + launch_per_output * (outputs - 1)
                     + launch_per_input * (inputs - 1)
    device(kernel) = kernel_latency + hypot(bytes_moved / hbm_bandwidth, flops / peak_flops)
    time(kernel)   = max(host, device)

A model launches its kernels back to back: while the GPU runs one kernel the host prepares the
next, so a kernel costs whichever side is slower, not their sum (the sum over-predicted the
measured time of Llama 4 x 1024's fused kernels by a median 31% on the H200; the max: 11%).
On the GPU, memory and arithmetic overlap less well than a max says when both are large: the
hypotenuse of the two (a smooth max) stands for it. BERT's bias + erf GELU over 4096 x 3072
bf16 (11.8 us of bytes, 10.5 us of FLOPs at the H200's 47.8 TFLOP/s estimate) measured
18.1-19.9 us (`dump --measure`, session 14), which the max put at 13.4 us and the hypotenuse
at 17.3; the same kernel with its erf taken out ran 5.4 us faster (benchmarks/variants.py).
A kernel whose FLOPs are small beside its bytes (a norm: one tenth) is costed as before.
bytes_moved counts each distinct tensor a kernel reads once, at its own size (a broadcast
operand is read at its size, not the result's), and each output once; an input read only by
gathers (an embedding table), at the bytes they gather (at most its size). A looped row kernel that
makes P passes over its rows reads its per-element inputs P times from HBM, unless those inputs
together fit in half the L2 cache: then the passes after the first hit L2 and cost no HBM bytes
(add+LayerNorm over 64 rows of 65536: 16 MB re-read, the H200's L2 is 50 MB). flops counts one
per output element of each op computed in the kernel, OP_FLOPS for exp, tanh, erf and the like
(views and casts are free). `fusion-compiler calibrate` measures the host terms through the
backend's own launchers and the GPU's latency per kernel. A fused group saves the
intermediates' write + read and the launches of the kernels it replaces (XLA's GPU performance
model).
"""
from __future__ import annotations

import functools
import math

from dataclasses import dataclass

from ..codegen.ops import CHEAP_EXPONENTS
from .shapes import hint


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hbm_bandwidth: float        # bytes / s, achievable (copy bandwidth), not the datasheet peak
    launch_overhead: float      # s of host time per kernel launch (back to back)
    peak_flops: float           # fp32 FLOP/s of the vector units (memory-bound ops do fp32 math)
    launch_per_output: float = 0.0  # s per output tensor past the first (its allocation)
    kernel_latency: float = 2e-6    # s of GPU time per kernel beyond its bytes and FLOPs
    launch_per_input: float = 0.0   # s per input tensor past the first (its address and key)
    l2_bytes: int = 0               # L2 cache size (0: every re-read pass counts as HBM bytes)


# The host terms (Python launch path, allocation, arguments) are the host's, not the GPU's:
# measured by `fusion-compiler calibrate` on the H200 machine of the anchors, 2026-11-30 (three
# runs: launch 7.9, 6.8 and 6.9 us; per further output 1.28, 1.23 and 1.26 us; per further
# input 0.82 and 0.18 us; GPU latency per kernel 1.6-1.7 us), and taken for every default
# profile. A calibrated profile replaces them with the user's own host's.
HOST = dict(launch_overhead=7.3e-6, launch_per_output=1.25e-6, launch_per_input=0.5e-6,
            kernel_latency=1.6e-6)

PROFILES = {
    # H200: copy 4.22-4.25 TB/s, bf16 matmul 707 TFLOP/s (calibrate, same runs)
    "h200": DeviceProfile("h200", hbm_bandwidth=4.22e12, peak_flops=44e12, l2_bytes=50 << 20,
                          **HOST),
    "h100": DeviceProfile("h100", hbm_bandwidth=3.0e12, peak_flops=44e12, l2_bytes=50 << 20,
                          **HOST),
    "a100": DeviceProfile("a100", hbm_bandwidth=1.7e12, peak_flops=19.5e12, l2_bytes=40 << 20,
                          **HOST),
    "l4": DeviceProfile("l4", hbm_bandwidth=0.27e12, peak_flops=30e12, l2_bytes=48 << 20, **HOST),
    "generic": DeviceProfile("generic", hbm_bandwidth=1.0e12, peak_flops=20e12, **HOST),
}


def profile_named(name: str) -> DeviceProfile:
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: {', '.join(PROFILES)}, "
                         "auto") from None


def without_host(profile: DeviceProfile) -> DeviceProfile:
    """``profile`` for a graph replayed from a CUDA graph: no host time per launch, output or
    input (the replay launches them all in one call), so a kernel costs its GPU time alone.
    Costed with host terms, a replayed graph's kernels would look launch-bound where they are
    not, and GPU work added to them (bytes read again, ops recomputed) would look free."""
    import dataclasses

    return dataclasses.replace(profile, name=f"{profile.name}+cudagraphs", launch_overhead=0.0,
                               launch_per_output=0.0, launch_per_input=0.0)


def resolve_profile(name: str, cache_dir) -> DeviceProfile:
    """``name`` from PROFILES, or "auto": the calibrated profile of the visible GPU if one was
    stored (`fusion-compiler calibrate`), else the defaults of its model, else "generic"."""
    if name.lower() != "auto":
        return profile_named(name)
    import json

    import torch

    if not torch.cuda.is_available():
        return PROFILES["h200"]
    gpu = torch.cuda.get_device_name()
    from ..calibrate import profile_path

    path = profile_path(cache_dir, gpu)
    if path.exists():
        try:
            return DeviceProfile(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass    # a damaged profile: fall back to the defaults below
    for key in ("h200", "h100", "a100", "l4"):
        if key in gpu.lower():
            return PROFILES[key]
    return PROFILES["generic"]


@dataclass(frozen=True)
class KernelCost:
    bytes_read: int
    bytes_written: int
    launches: int
    time: float             # seconds

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def tensor_bytes(node, size_hints: dict) -> int:
    info = node.meta["fc_tensor"]
    return hint(info.numel, size_hints) * info.itemsize


# FLOPs an element of each op costs: the PTX instructions per element of the expression the
# code generator writes for it, for sm_90 (benchmarks/op_instructions.py; libdevice's erf,
# tanh and log are polynomials of some 30 instructions, exp is one MUFU ex2 and a multiply).
# Every other op that computes costs 1 (div, sqrt and rsqrt are one PTX instruction each); views
# and casts cost 0.
OP_FLOPS = {"exp": 2, "exp2": 1, "expm1": 29, "log": 32, "log2": 35, "log1p": 35,
            "tanh": 28, "sigmoid": 5, "erf": 35, "sin": 96, "cos": 96}
POW_FLOPS = 125      # pow with a tensor exponent or one not in CHEAP_EXPONENTS (libdevice's powf)
_FREE = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "slice",
         "select", "unsqueeze", "squeeze", "as_strided", "clone", "_to_copy", "alias",
         "convert_element_type", "cat", "split", "chunk"}


@functools.lru_cache(maxsize=4096)
def op_name(target) -> str:
    """'aten.mul.Tensor' -> 'mul'; a target without a namespace as its text."""
    text = str(target)
    return text.split(".")[1] if "." in text else text


def op_flops(node, size_hints: dict) -> int:
    """FLOPs of one op per the model above: its output elements, times its weight."""
    name = op_name(node.target)
    if name in _FREE or "fc_tensor" not in node.meta:
        return 0
    if name == "pow":       # codegen/ops.py's _pow: a few exponents are a product or the like
        e = node.args[1] if len(node.args) > 1 else None
        weight = 2 if isinstance(e, (int, float)) and e in CHEAP_EXPONENTS else POW_FLOPS
    else:
        weight = OP_FLOPS.get(name, 1)
    return weight * hint(node.meta["fc_tensor"].numel, size_hints)


class NodeSizes:
    """``tensor_bytes`` and ``op_flops`` of each node of one graph at its size hints, worked out
    once: the fuse search costs some 1400 candidate groups on Llama 1 x 128, each made of
    nodes it has costed before."""

    def __init__(self, size_hints: dict):
        self.size_hints = size_hints
        self._bytes: dict = {}
        self._flops: dict = {}

    def bytes(self, node) -> int:
        found = self._bytes.get(node)
        if found is None:
            found = self._bytes[node] = tensor_bytes(node, self.size_hints)
        return found

    def flops(self, node) -> int:
        found = self._flops.get(node)
        if found is None:
            found = self._flops[node] = op_flops(node, self.size_hints)
        return found


def kernel_cost(inputs, outputs, passes: int, row_inputs, size_hints, profile,
                members=(), reread=(), gathered=None, sizes: NodeSizes | None = None
                ) -> KernelCost:
    """Cost of one kernel reading ``inputs``, computing ``members`` and writing ``outputs``
    (FX nodes). ``row_inputs`` are the inputs re-read on each of ``passes`` passes (looped row
    kernels); ``reread``, inputs read once more each (by another part of a multi-part
    kernel). A re-read comes from L2, not HBM, when what is re-read fits in half of it.
    ``gathered``: the bytes read of inputs read by index (embedding tables), not their size.
    ``sizes``: the nodes' bytes and FLOPs at ``size_hints``, if the caller keeps them."""
    gathered = gathered or {}
    sizes = sizes or NodeSizes(size_hints)
    if passes > 1 and 2 * sum(sizes.bytes(n) for n in row_inputs) <= profile.l2_bytes:
        passes = 1                          # the later passes read L2, not HBM
    read = sum((gathered[n] if n in gathered else sizes.bytes(n))
               * (passes if n in row_inputs else 1) for n in inputs)
    reread_bytes = sum(sizes.bytes(n) for n in reread)
    if 2 * reread_bytes > profile.l2_bytes:
        read += reread_bytes
    written = sum(sizes.bytes(n) for n in outputs)
    flops = sum(sizes.flops(n) for n in members)
    host = (profile.launch_overhead + profile.launch_per_output * max(len(outputs) - 1, 0)
            + profile.launch_per_input * max(len(inputs) - 1, 0))
    device = profile.kernel_latency + math.hypot((read + written) / profile.hbm_bandwidth,
                                                 flops / profile.peak_flops)
    t = max(host, device)
    return KernelCost(read, written, 1, t)
