"""Configuration: defaults, overridden by FUSION_COMPILER_* environment variables.

Every threshold the passes and the code generator use lives here, with its reason.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is wrong; the message names it and says what is allowed."""


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusion-compiler"


@dataclass(frozen=True)
class Config:
    # Where generated kernel sources live (FUSION_COMPILER_CACHE_DIR).
    cache_dir: Path = None
    # Turn fusion off entirely: every op runs on ATen (FUSION_COMPILER_DISABLE=1).
    disable: bool = False
    # Raise compile errors instead of falling back to ATen with a warning (tests set it).
    strict: bool = False
    # Largest power-of-two row block held in registers; longer rows use the looped kernel.
    max_persistent_block: int = 16384
    # Longest static row a program holds in registers as chunks (the resident kernel: read
    # once) where it is longer than max_persistent_block; longer rows loop. 0: they all loop.
    max_resident_row: int = 53248
    # Most ops one fused group may hold: bounds compile time and register pressure.
    max_group_ops: int = 128
    # Generate kernel sources even where they will not run (CPU without the interpreter), so
    # `fusion-compiler dump --code` can show them.
    emit_sources: bool = False
    # Cost model device profile: a name from passes/cost_model.PROFILES, or "auto" (the stored
    # calibration of the visible GPU, else its model's defaults; h200 numbers without a GPU).
    profile: str = "auto"
    # Capture inference graphs with static shapes into CUDA graphs (fusion_compiler/cudagraphs.py);
    # also set by torch.compile(..., mode="reduce-overhead").
    cudagraphs: bool = False
    # With CUDA graphs: copy each output out of the graph's memory after a replay, so results
    # stay valid after the next call (else, as Inductor does, they are valid until then).
    cudagraph_copy_outputs: bool = False
    # Threads compiling a graph's Triton kernels at compile time (codegen/precompile.py); 0
    # leaves each kernel to compile on its first launch, one after another.
    compile_threads: int = 8
    # Worker processes compiling Triton kernels beside this process (codegen/compile_pool.py),
    # started with the first GPU graph: at most the usable cores less two; 0: threads only.
    compile_workers: int = 8
    # Kernels per graph whose launch settings are tuned by timing on the GPU (the ones moving
    # the most bytes; codegen/autotune.py), results cached on disk; 0: the rules of launch.py.
    autotune: int = 0
    # Training: recompute cheap forward values in the backward graph instead of saving them
    # (aot_autograd's min-cut partitioner, as Inductor does): fewer saved activations, less
    # memory, and the recomputed ops fuse into the backward's kernels. 0: save what the
    # backward reads, as eager autograd does.
    backward_recompute: bool = True
    # Sums over leading dimensions (bias and norm-weight gradients) summed as rows of their
    # permuted view, in two kernels that take their producers along (passes/column_sums.py);
    # 0: left to ATen's reduction.
    column_sums: bool = True
    # Attention on key/value heads repeated for grouped-query attention reads the grouped heads
    # instead, where its kernel takes them (cuDNN, Flash; inference graphs): the repeat's copies
    # are not made (passes/grouped_attention.py). 0: the graph's copies are kept.
    grouped_attention: bool = True
    # Depthwise 1-d convolutions of up to 8 taps (the Mamba family's causal convolution) as
    # pointwise sums of shifted products in fp32 that fuse with their neighbours
    # (passes/depthwise_conv.py). 0: left to cuDNN / ATen.
    depthwise_conv: bool = True
    # Convolution networks keep their activations in channels-last memory, where Inductor's
    # rules pick it (passes/channels_last.py): cuDNN computes in NHWC, and NCHW activations
    # cost it a transpose in and out of each convolution. 0: the layouts the model gives.
    channels_last: bool = True
    # 2-d max pooling and its backward as ops the kernels fuse (fusion_compiler/max_pool.py):
    # the pool in the kernel computing its input, two bytes an output kept for the backward.
    # 0: ATen's max_pool2d_with_indices and its backward.
    max_pool: bool = True
    # A pointwise kernel with an access along another dim than its innermost (a transposed
    # output) takes 2-d tiles, so that each load and store walks contiguous memory
    # (codegen/tiles.py). 0: 1-d blocks, the transposed accesses one element a sector.
    tiles: bool = True
    # Keep aot_autograd's result (the ATen forward and backward graphs, or the inference
    # graph, and its runtime wrappers) on disk in torch's AOTAutograd cache, so that a second
    # process compiling the same model skips aot_autograd's trace and partition
    # (fusion_compiler/aot_cache.py); the passes still run on the stored graphs. 0:
    # aot_autograd runs every time.
    aot_cache: bool = True
    # Each fused kernel's launch inside a profiler range named after its group,
    # ``fc#<group id> <label>`` (passes/partition.py): a torch.profiler trace then shows which
    # of the `dump`'s groups each kernel is (they all share a few kernel names). Off: nothing
    # on the call path.
    profile_ranges: bool = False

    @staticmethod
    def from_env(env=None) -> "Config":
        env = os.environ if env is None else env
        cfg = Config(cache_dir=_default_cache_dir())
        updates = {}
        if env.get("FUSION_COMPILER_CACHE_DIR"):
            updates["cache_dir"] = Path(env["FUSION_COMPILER_CACHE_DIR"]).expanduser()
        for f in fields(Config):
            name = "FUSION_COMPILER_" + f.name.upper()
            if f.name == "cache_dir" or name not in env:
                continue
            updates[f.name] = _parse(name, env[name], f.type)
        if "profile" in updates:
            from .passes.cost_model import PROFILES
            if updates["profile"].lower() not in (*PROFILES, "auto"):
                raise ConfigError(f"FUSION_COMPILER_PROFILE={updates['profile']!r}: expected one "
                                  f"of {', '.join((*PROFILES, 'auto'))}")
        return replace(cfg, **updates)


MODES = {"default": {}, "reduce-overhead": {"cudagraphs": True},
         "max-autotune": {"cudagraphs": True}, "max-autotune-no-cudagraphs": {}}


def with_compile_args(config: Config, mode=None, options=None) -> Config:
    """``config`` updated by torch.compile's ``mode=`` and ``options=`` for this backend."""
    updates = {}
    if mode is not None:
        if mode not in MODES:
            raise ConfigError(f"torch.compile(mode={mode!r}): the fusion backend knows "
                              f"{', '.join(MODES)}")
        updates.update(MODES[mode])
    known = {f.name: f.type for f in fields(Config)}
    for name, value in (options or {}).items():
        if name not in known:
            raise ConfigError(f"torch.compile(options={{{name!r}: ...}}): unknown option; the "
                              f"fusion backend's options are {', '.join(known)}")
        typ = {"bool": bool, "int": int, "str": str}.get(known[name])
        if name == "cache_dir" and isinstance(value, (str, os.PathLike)):
            value = Path(value).expanduser()
        elif typ is not None and not (isinstance(value, typ) and
                                      (typ is not int or not isinstance(value, bool))):
            raise ConfigError(f"torch.compile(options={{{name!r}: {value!r}}}): expected "
                              f"{known[name]}")
        if typ is int and value < _least(name):
            raise ConfigError(f"torch.compile(options={{{name!r}: {value!r}}}): expected "
                              f"{_INT_WORDS[_least(name)]}")
        updates[name] = value
    return replace(config, **updates)


# integer settings are positive, except these, where 0 turns something off
_ZERO_ALLOWED = {"compile_threads", "compile_workers", "autotune", "max_resident_row"}
_INT_WORDS = {0: "an integer >= 0", 1: "a positive integer"}


def _least(name: str) -> int:
    return 0 if name.lower().removeprefix("fusion_compiler_") in _ZERO_ALLOWED else 1


def _parse(name: str, raw: str, typ: str):
    if typ == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}={raw!r}: expected 0 or 1")
    if typ == "int":
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected {_INT_WORDS[_least(name)]}") from None
        if value < _least(name):
            raise ConfigError(f"{name}={raw!r}: expected {_INT_WORDS[_least(name)]}")
        return value
    return raw
