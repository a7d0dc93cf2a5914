"""aot_autograd's result kept on disk, so a second process skips its trace and partition.

A warm compile spends most of its time in aot_autograd, not in the passes: GPT-2 8 x 512's
warm training compile (kernel and decision caches full) took 5.65 s on the H200's host, of
which the functional trace 3.5 s and the min-cut partitioner 2.0 s under cProfile (session
30); Llama 1 x 128's warm inference compile spent 1.1 s of its 1.6 s in the backend in
aot_autograd's trace (session 33). Inductor skips both on a warm start with torch's
AOTAutograd cache; this module lets the fusion backend use the same cache:

- each ATen graph (forward, backward, inference) is returned wrapped in ``FusionOutputCode``, an
  ``OutputCode`` that keeps the graph as aot_autograd handed it over (``GraphPickler``: nodes
  and their values, node metadata cut to ``val``, each tensor value kept as its layout and made
  a fake tensor again on loading: ``_Layout``) beside the compiled callable;
- aot_autograd stores that, with its own runtime metadata and wrappers, under a key of the
  Dynamo graph, the inputs' metadata, aot_autograd's config, grad mode, autocast and the
  values of the graph's tensor constants (``_key``, used in place of torch's own key, which
  also hashes Inductor's configuration and the Triton and torch sources: 1 s a process);
- on a hit in a later process it hands the stored graph back, and ``post_compile`` runs the
  passes on it again (their kernel and decision caches make that quick). So what is cached is
  only aot_autograd's work; every fusion decision and kernel is the current code's.

The entries live under ``<cache_dir>/aot/<namespace>``: apart from Inductor's, and in a
namespace that hashes what the ATen graph depends on besides the key: the front end's source
(``fusion_compiler/*.py``: the decomposition table, how the backend calls aot_autograd; hashed
once at import), the partitioner chosen (``backward_recompute``) and the torch version.
Keeping an entry adds the key, the pickling and the write to a cold compile: 0.15-0.2 s on the
CPU for the inference graph of a 12-layer GPT-2 of width 64. ``FusionOutputCode`` refuses to be
stored (torch then bypasses the cache for that graph, compiling as before) where the graph
has dynamic shapes (the passes read size hints a fresh ShapeEnv would not have) or does not
pickle.

torch's ``save`` is wrapped while the backend compiles (``_storable``): an output that
aot_autograd rebuilds by replaying an ``_unsafe_view`` or ``resize_`` ViewMeta is stored without
that sequence, since those two pickle their shape from freed memory (pytorch#185630).

The backward graph is compiled with the forward (``force_non_lazy_backward_lowering``) rather
than at the first backward call, because torch writes the entry when both are compiled and
only inside ``context()`` is it told to keep our ``OutputCode`` whole. Off with
``FUSION_COMPILER_AOT_CACHE=0`` (or ``options={"aot_cache": False}``), and where this torch
lacks the pieces (``available()``).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from .codegen.cache import source_fingerprint
from .passes import late_decompose
from .passes.shapes import fake_of_layout, static_layout

log = logging.getLogger("fusion_compiler")

FORMAT = "3"        # bump when what FusionOutputCode stores changes

try:
    from torch._functorch._aot_autograd import autograd_cache as _torch_cache
    from torch._functorch._aot_autograd.autograd_cache import (AOTAutogradCache,
                                                                AOTAutogradCachePickler,
                                                                BypassAOTAutogradCache,
                                                                check_cacheable,
                                                                sanitize_gm_for_cache)
    from torch._dynamo.utils import GmWrapper
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode
    from torch.fx._graph_pickler import GraphPickler, Options
    _MISSING = None
except ImportError as exc:     # an older torch: the backend compiles as before
    _MISSING = str(exc)
    OutputCode = object

_CONFIG_FLAGS = ("enable_autograd_cache", "bundled_autograd_cache",
                 "force_non_lazy_backward_lowering")

# the backend's graph compiler for the compile in progress: (aten_gm, kind, static inputs) ->
# boxed callable. Set by context(); post_compile (a cache hit) compiles with it.
_finish: contextvars.ContextVar = contextvars.ContextVar("fusion_aot_finish", default=None)
# called, once the key is known, when no entry is stored under it: the graph will be traced and
# compiled (the backend starts its compile workers then; a hit needs none: its kernels are in
# Triton's cache). Set by context()
_on_miss: contextvars.ContextVar = contextvars.ContextVar("fusion_aot_on_miss", default=None)


def available() -> str | None:
    """None if this torch can keep aot_autograd's result for the backend, else why not."""
    if _MISSING is not None:
        return f"torch lacks the AOTAutograd cache's pieces ({_MISSING})"
    import torch._functorch.config as functorch_config
    missing = [f for f in _CONFIG_FLAGS if not hasattr(functorch_config, f)]
    if missing:
        return f"torch._functorch.config lacks {', '.join(missing)}"
    for owner, name in ((AOTAutogradCache, "_get_tmp_dir"), (_torch_cache, "autograd_cache_key")):
        if not hasattr(owner, name):
            return f"torch's AOTAutograd cache has no {name}"
    if not isinstance(AOTAutogradCache.__dict__.get("save"), staticmethod):
        return "torch's AOTAutogradCache.save is not a static method"
    return None


MAX_CONSTANT_BYTES = 64 << 20   # tensor attributes of the Dynamo graph hashed by value, at most


class _KeyDetails:
    """What an entry's key hashes (torch's AOTAutogradCachePickler reduces the graph module,
    tensors and the aot config in it): the Dynamo graph's code and attributes, the inputs'
    metadata, aot_autograd's config and torch's state that changes the ATen graph it traces.
    In place of torch's own key, which adds Inductor's configuration and hashes the Triton and
    torch sources in this process (1 s of a warm GPT-2 compile on the CPU, against 0.1)."""

    def __init__(self, gm, example_inputs, aot_config):
        import torch._functorch.config as functorch_config

        self.gm = gm
        self.example_inputs = list(example_inputs)
        self.aot_config = aot_config
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = sorted((d, str(torch.get_autocast_dtype(d)))
                               for d in torch._C._autocast_supported_devices()
                               if torch.is_autocast_enabled(d))
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.functorch_config = functorch_config.save_config()
        self.default_dtype = str(torch.get_default_dtype())
        devices = sorted({t.device.index or 0 for t in self.example_inputs
                          if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
        self.cuda = [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
                     for i in devices]
        sdp = torch.backends.cuda
        self.sdp = [f() for f in (sdp.flash_sdp_enabled, sdp.mem_efficient_sdp_enabled,
                                  sdp.math_sdp_enabled, getattr(sdp, "cudnn_sdp_enabled", bool))]
        # a convolution's output layout in the trace follows the backend ATen picks: cuDNN's
        # channels-last where its input is, the native kernels' contiguous where cuDNN is off
        self.conv_backends = (torch.backends.cudnn.enabled, torch.backends.mkldnn.enabled)
        self.constants = _constant_values(gm)


def _constant_values(gm) -> str:
    """Hash of the values of the graph module's plain tensor attributes (Dynamo's lifted
    constants). torch's key has their metadata only, and aot_autograd copies them into the
    ATen graph, which the entry keeps. Parameters and buffers are not among them: aot_autograd
    makes those inputs of the graph, read on every call."""
    h = hashlib.sha256()
    total = 0
    for name, value in sorted(vars(gm).items()):
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
            if total > MAX_CONSTANT_BYTES:
                raise BypassAOTAutogradCache("fusion-compiler: the graph's tensor constants "
                                             f"exceed {MAX_CONSTANT_BYTES >> 20} MiB")
            h.update(repr((name, value.dtype, tuple(value.shape))).encode())
            data = value.detach().cpu().contiguous().reshape(-1)
            h.update(data.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# the AOTConfig fields that torch's key pickler reduces the config to (2.11-2.13), logged one by
# one at DEBUG level
_AOT_CONFIG_KEYED = ("num_params_buffers", "keep_inference_input_mutations", "is_export",
                     "no_tangents", "dynamic_shapes", "aot_autograd_arg_pos_to_source",
                     "static_input_indices", "enable_log", "pre_dispatch", "precompile_backend_id")


def _key(mod, example_inputs, aot_config, *args, **kwargs):
    """torch's ``autograd_cache_key`` for the backend's entries: (key, debug lines). Where no
    entry is stored under the key, or the graph is not cached at all, the ``on_miss`` callback
    of ``context`` runs first."""
    try:
        key, lines = _entry_key(mod, example_inputs, aot_config)
    except Exception:           # not cached (a bypass): traced and compiled
        _missing()
        raise
    if not _stored(key):
        _missing()
    return key, lines


def _stored(key: str) -> bool:
    """Whether an entry is stored under ``key`` (torch keeps a key's entries in a folder of
    that name). One that then fails to load is a miss that found workers not started: its
    kernels compile on threads, as without workers."""
    try:
        return any((Path(AOTAutogradCache._get_tmp_dir()) / key).iterdir())
    except OSError:
        return False


def _missing() -> None:
    callback = _on_miss.get()
    if callback is not None:
        callback()


def _entry_key(mod, example_inputs, aot_config):
    gm = mod.gm if isinstance(mod, GmWrapper) else mod
    if hasattr(gm, "saved_tensors_hooks_pack_0"):
        raise BypassAOTAutogradCache("fusion-compiler: saved tensors hooks are not cached")
    with sanitize_gm_for_cache(gm):
        check_cacheable(gm)
        details = _KeyDetails(gm, example_inputs, aot_config)
        key = "a" + AOTAutogradCachePickler(gm).get_hash(details)
        if log.isEnabledFor(logging.DEBUG):     # what a miss in a later process differs in
            parts = {name: AOTAutogradCachePickler(gm).get_hash(value)[:12]
                     for name, value in vars(details).items()}
            parts.update({f"aot_config.{name}": repr(value)[:200]
                          for name, value in sorted(vars(aot_config).items())
                          if name in _AOT_CONFIG_KEYED})
            log.debug("fusion-compiler: AOT cache key %s: %s", key, json.dumps(parts))
        return key, []


# the front end's sources: the decomposition table and how backend.py calls aot_autograd
_FINGERPRINT = source_fingerprint(Path(__file__).parent, salt=FORMAT)


def namespace(cache_dir: Path, partition: str) -> Path:
    """The folder for entries made by this code with this partitioner and this torch."""
    h = hashlib.sha256(repr((_FINGERPRINT, torch.__version__, partition)).encode())
    return Path(cache_dir) / "aot" / h.hexdigest()[:16]


def _pickled(gm: torch.fx.GraphModule) -> tuple[bytes | None, str | None]:
    """(the graph pickled, None), or (None, why it is not kept)."""
    # the passes read a node's "val", and dump's labels the op it was decomposed from
    # ("original_aten", kept as its name); the rest (stack traces, module stacks, provenance:
    # 7.7 MB pickled for GPT-2's training graphs) is left out of the copy, not the graph. The
    # values go as their layouts (_Layout), not as fake tensors
    nodes = list(gm.graph.nodes)
    metas = [node.meta for node in nodes]
    try:
        for node, meta in zip(nodes, metas):
            node.meta = {"val": _layouts(meta["val"])} if "val" in meta else {}
            if "original_aten" in meta:
                node.meta["original_aten"] = str(meta["original_aten"])
        return GraphPickler.dumps(_uncompiled(gm), Options(ops_filter=None)), None
    except _Dynamic:
        return None, "dynamic shapes"
    except Exception as exc:  # noqa: BLE001 - a graph that does not pickle is compiled, not kept
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        for node, meta in zip(nodes, metas):
            node.meta = meta


def _snapshot(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A stand-in for ``gm`` as it is now, to pickle later (``_pickled``): its graph copied,
    nodes and their metadata dicts (7-10 ms for Llama 1 x 128's 708 nodes on the CPU, against
    31-35 ms to pickle them), and its attribute tables copied; the values are shared."""
    stand_in = _uncompiled(gm)
    state = stand_in.__dict__
    state["_graph"] = copy.deepcopy(gm.graph)
    state["_graph"].owning_module = stand_in
    for table in ("_parameters", "_buffers", "_modules"):
        if table in state:
            state[table] = copy.copy(state[table])
    return stand_in


class _Uncompiled(torch.fx.GraphModule):
    """A graph module whose ``recompile`` does nothing. GraphPickler compiles a module's code
    before pickling it (0.05-0.09 s a GPT-2 training graph on the CPU); the stored graph's code
    is compiled after its passes, once it is loaded (``backend.with_code``)."""

    def recompile(self):
        return None


def _uncompiled(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A stand-in for ``gm`` to pickle: the same attributes and graph, no code compiled."""
    stand_in = _Uncompiled.__new__(_Uncompiled)
    object.__setattr__(stand_in, "__dict__", dict(gm.__dict__))
    return stand_in


class _Layout(tuple):
    """A tensor value of the graph as the passes read it: (sizes, strides, storage offset,
    dtype, device). GraphPickler pickles a fake tensor with its whole description and makes it
    again through meta_utils (half of unpickling GPT-2's graphs); this is a tuple."""


class _Dynamic(Exception):
    """A value with a symbolic size: the passes read size hints that a fresh ShapeEnv would
    not have, so the graph is not kept."""


def _layouts(val):
    """``val`` (a node's value) with its tensors as ``_Layout``s; ``_Dynamic`` where a size,
    stride or offset is symbolic."""
    if isinstance(val, torch.Tensor):
        layout = static_layout(val)
        if layout is None:
            raise _Dynamic
        return _Layout(layout)
    if isinstance(val, (list, tuple)):
        return type(val)(_layouts(v) for v in val)
    if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise _Dynamic
    if val is None or isinstance(val, (bool, int, float)):
        return val
    raise TypeError(f"a node's value of type {type(val).__name__}")


def _fakes(val, mode):
    """``val`` with its ``_Layout``s made fake tensors of ``mode`` again (``fake_of_layout``)."""
    if isinstance(val, _Layout):
        return fake_of_layout(mode, *val)
    if isinstance(val, (list, tuple)):
        return type(val)(_fakes(v, mode) for v in val)
    return val


@dataclasses.dataclass
class FusionOutputCode(OutputCode):
    """A compiled ATen graph as aot_autograd's cache stores it: the graph, not the kernels."""
    kind: str = "forward"
    static_inputs: tuple = ()
    blob: bytes | None = None           # the ATen graph, pickled before the passes ran
    not_kept: str | None = None         # why blob is None
    fn: Callable | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        self._boxed_call = True         # on the instance: torch's wrappers copy its __dict__

    def __call__(self, inputs: Any) -> Any:
        return self.fn(inputs)

    def prepare_for_serialization(self) -> None:
        if self.blob is None:
            raise BypassAOTAutogradCache(f"fusion-compiler: {self.kind} graph not kept "
                                         f"({self.not_kept})")
        self.fn = None

    def post_compile(self, *args: Any, **kwargs: Any) -> None:
        if self.fn is not None:         # compiled in this process
            return
        finish = _finish.get()
        if finish is None:
            raise RuntimeError("fusion-compiler: a cached graph was loaded outside the "
                               "fusion backend's compile")
        from torch._subclasses import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # its code is compiled by the backend, where the graph runs as it is (a pass failed)
        mode = FakeTensorMode(shape_env=ShapeEnv())
        gm = GraphPickler.loads(self.blob, mode)
        for node in gm.graph.nodes:
            if "val" in node.meta:
                node.meta["val"] = _fakes(node.meta["val"], mode)
        self.fn = finish(gm, self.kind, list(self.static_inputs))

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


def compiler(kind: str, finish: Callable, static_inputs: Callable[[], list]):
    """aot_autograd's compiler for ``kind`` graphs: ``finish`` compiles, the result is kept."""
    def compile_fn(gm: torch.fx.GraphModule, example_inputs) -> FusionOutputCode:
        # the ops the trace kept whole, decomposed before the graph is kept: a warm compile
        # then loads them decomposed and traces no make_fx template (GPT-2 8 x 512's warm
        # analysis on the CPU: 0.30-0.36 s running the pass on the loaded graph, 0.19-0.26
        # loading it decomposed). An error here is met again in the pipeline, which raises it
        # (FUSION_COMPILER_STRICT) or leaves the op to ATen
        try:
            late_decompose.run(gm, None)
        except Exception as exc:  # noqa: BLE001
            log.info("fusion-compiler: late decomposition before keeping the graph failed "
                     "(%s: %s)", type(exc).__name__, exc)
        static = tuple(static_inputs())
        out = FusionOutputCode(kind=kind, static_inputs=static)
        kept = _snapshot(gm)            # now: the passes rewrite gm in place

        def keep():                     # pickled while the kernels compile
            out.blob, out.not_kept = _pickled(kept)
        out.fn = finish(gm, kind, list(static), meanwhile=keep)
        return out
    return SerializableAOTDispatchCompiler(FusionOutputCode, compile_fn)


# ViewMeta classes whose pickled state is corrupt in torch up to 2.13 (pytorch#185630: their
# shape fields are references to freed vectors): a stored entry replays such an output view with
# a garbage shape. Without its sequence, aot_autograd rebuilds that output from its base's
# layout (as_strided), as it does for views of symbolic sizes
_CORRUPT_VIEW_METAS = frozenset({"_unsafe_view_ViewMeta", "resize__ViewMeta"})


def _corrupt_views(info) -> bool:
    sequence = getattr(info, "view_meta_sequence", None)
    return sequence is not None and any(type(meta).__name__ in _CORRUPT_VIEW_METAS
                                        for meta in sequence.sequence)


def _storable(entry):
    """``entry`` as it may be pickled: a copy without the view sequences of its outputs that
    would not survive pickling (``_CORRUPT_VIEW_METAS``); ``entry`` itself where none has one.
    The entry stays as it is: this process goes on running it."""
    meta = getattr(entry, "runtime_metadata", None)
    infos = getattr(meta, "output_info", None) or []
    corrupt = [k for k, info in enumerate(infos) if _corrupt_views(info)]
    if not corrupt:
        return entry
    log.debug("fusion-compiler: AOT cache entry keeps outputs %s without their view replay "
              "(pytorch#185630)", corrupt)
    meta = copy.copy(meta)
    meta.output_info = [dataclasses.replace(info, view_meta_sequence=None)
                        if k in corrupt else info for k, info in enumerate(infos)]
    entry = copy.copy(entry)
    entry.runtime_metadata = meta
    return entry


@contextlib.contextmanager
def context(folder: Path, finish: Callable, on_miss: Callable[[], None] | None = None):
    """aot_autograd, inside this, reads and writes the backend's entries in ``folder``;
    ``on_miss()`` runs before a graph with no stored entry is traced."""
    import torch._functorch.config as functorch_config

    token = _finish.set(finish)
    miss_token = _on_miss.set(on_miss)
    saved_dir = AOTAutogradCache.__dict__["_get_tmp_dir"]
    saved_key = _torch_cache.autograd_cache_key
    saved_save = AOTAutogradCache.__dict__["save"]
    AOTAutogradCache._get_tmp_dir = classmethod(lambda cls: str(folder))
    AOTAutogradCache.save = staticmethod(
        lambda key, entry, remote: saved_save.__func__(key, _storable(entry), remote))
    _torch_cache.autograd_cache_key = _key
    try:
        with functorch_config.patch(**dict.fromkeys(_CONFIG_FLAGS, True)):
            yield
    finally:
        AOTAutogradCache._get_tmp_dir = saved_dir
        AOTAutogradCache.save = saved_save
        _torch_cache.autograd_cache_key = saved_key
        _finish.reset(token)
        _on_miss.reset(miss_token)
