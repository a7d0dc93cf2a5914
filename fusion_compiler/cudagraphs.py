"""CUDA graphs for compiled inference graphs with static shapes (an option: launch-bound models).

A model run at batch 1 spends its time launching kernels, not running them. With
``torch.compile(model, backend="fusion", mode="reduce-overhead")`` (or
``options={"cudagraphs": True}``, or FUSION_COMPILER_CUDAGRAPHS=1) each eligible inference graph
is captured once into a CUDA graph and replayed: one launch per call whatever the kernel count.

How inputs and outputs are handled, so nothing is silently wrong:
- Parameters and buffers (aot_autograd's static inputs) are captured in place. If one moves
  later (weights replaced), the graph is captured again; after ``MAX_CAPTURES`` captures the
  graph runs without CUDA graphs, with a warning.
- Other inputs are copied into the graph's own input buffers before each replay.
- Outputs are the graph's own memory, as with Inductor's ``mode="reduce-overhead"``: a result
  is valid until the next call of the same compiled graph, which overwrites it. Each output
  handed out is a tensor of its own (its own storage object over the graph's memory); on the
  next replay the ones still alive are marked, so reading one of them, or a view of one,
  raises an error that says to clone it (``STALE``) instead of returning overwritten values.
  Copying every output instead costs a read and a write of each (GPT-2's 412 MB of logits:
  ~200 us a call on the H200); ``options={"cudagraph_copy_outputs": True}`` (or
  FUSION_COMPILER_CUDAGRAPH_COPY_OUTPUTS=1) asks for it, and it is what runs where this torch
  lacks the C helpers for the first way.

Not captured (the graph runs as usual, and the log says why): training graphs, dynamic
shapes, CPU tensors, random ops, ops that read device values on the host, graphs that write
into an input that is not a parameter or buffer (aot_autograd keeps such writes in the graph:
a replay would write the graph's own copy of it).
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch

log = logging.getLogger("fusion_compiler")

MAX_CAPTURES = 3
# ops (by ATen name) whose result would be frozen at capture time or that synchronize with
# the host
_UNSAFE = {"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
           "bernoulli", "normal", "uniform", "exponential", "geometric", "log_normal", "cauchy",
           "multinomial", "native_dropout", "dropout", "_local_scalar_dense", "item", "nonzero",
           "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}


STALE = ("fusion-compiler: this tensor is an output of a CUDA graph (mode='reduce-overhead') "
         "that a later call of the same compiled model has overwritten. Clone it "
         "(out.clone()) before the next call to keep it, or compile with "
         "options={'cudagraph_copy_outputs': True}.")
# the C helpers Inductor's CUDA graph trees use for the same purpose (CUDA builds of torch)
_POOL_OUTPUTS = all(hasattr(torch._C, name) for name in (
    "_set_storage_data_ptr_access_error_msg", "_construct_storage_from_data_pointer",
    "_construct_CUDA_Tensor_From_Storage_And_Metadata"))


def _op_name(target) -> str:
    name = getattr(target, "_opname", None) or getattr(target, "__name__", "") or ""
    return name.rstrip("_")     # in-place variants (bernoulli_, uniform_) share the name


def static_input_indices() -> list:
    """Indices of the graph inputs that are parameters or buffers (aot_autograd knows them)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx else None
    return list(getattr(meta, "static_input_indices", None) or ())


def why_not(gm: torch.fx.GraphModule, kind: str, static_inputs=None) -> str | None:
    """None if the graph can be captured, else the reason it is not. ``static_inputs``: the
    indices of the graph's parameters and buffers (default: aot_autograd's, from the
    tracing context)."""
    if kind != "inference":
        return "CUDA graphs are used for inference graphs only"
    static = set(static_input_indices() if static_inputs is None else static_inputs)
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        for arg, a in zip(schema.arguments if schema else (), node.args):
            if a in index and index[a] not in static and arg.alias_info is not None \
                    and arg.alias_info.is_write:
                # a replay reads and writes the graph's own copy of such an input
                return f"it writes into its input {a.name} ({node.target}), not a buffer"
    for node in gm.graph.nodes:
        if node.op == "call_function" and _op_name(node.target) in _UNSAFE:
            return f"{node.target} cannot be replayed from a CUDA graph"
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and not isinstance(val, torch.Tensor):
            return f"input {node.name} is not a tensor (dynamic shapes)"
        if isinstance(val, torch.Tensor):
            if val.device.type != "cuda":
                return f"{node.name} is a {val.device.type} tensor"
            if any(not isinstance(s, int) for s in val.shape):
                return f"{node.name} has a dynamic shape"
    return None


class CudaGraphRunner:
    """A boxed callable: runs ``fn`` once as usual, then captures it and replays it."""

    def __init__(self, fn, name: str, static_inputs=(), copy_outputs=False):
        self.fn, self.name = fn, name
        self.static_inputs = set(static_inputs)     # indices of parameters and buffers
        self.copy_outputs = copy_outputs or not _POOL_OUTPUTS
        self.warm = False
        self.captures = 0
        self.disabled = False
        self.graph = None
        # the storages of the last replay's outputs, marked stale when their memory is next
        # written or freed (the caller's views of an output share its storage, and the mark)
        self.handed = []
        weakref.finalize(self, _mark_stale, self.handed)

    _boxed_call = True          # aot_autograd passes the argument list itself

    def __call__(self, args):
        if self.graph is not None:
            for i, p in self.stable:
                if args[i].data_ptr() != p:
                    self.graph = None             # an input captured in place moved
                    break
            else:
                for i, dst in self.copied:
                    dst.copy_(args[i])
                return self._replay()
        if self.disabled:
            return self.fn(args)
        if not self.warm:                         # first call: plain (kernels compile here)
            self.warm = True
            return self.fn(args)
        return self._capture(args)

    def _capture(self, args):
        if self.captures >= MAX_CAPTURES:
            log.warning("fusion-compiler: %s: inputs captured in place keep moving; running "
                        "without CUDA graphs from now on", self.name)
            self.disabled = True
            return self.fn(args)
        self.captures += 1
        _mark_stale(self.handed)        # the old graph's memory goes with it
        self.graph = self.outs = None
        args = list(args)
        # parameters, and inputs with overlapping elements (expanded: no buffer can take a
        # copy with their strides), are captured in place
        keep = [i in self.static_inputs or (isinstance(a, torch.Tensor)
                                             and torch._debug_has_internal_overlap(a) != 0)
                for i, a in enumerate(args)]
        static = [a if k or not isinstance(a, torch.Tensor) else
                  torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                  for a, k in zip(args, keep)]
        for a, s in zip(args, static):
            if s is not a:
                s.copy_(a)
        # warm-up on a side stream, as CUDA graph capture asks: one per device for the process,
        # since cuBLAS keeps a workspace (32 MiB on the H200) for every stream it ran on
        side = _side_stream(static)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(list(static))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with _own_cublas_workspace():
                with torch.cuda.graph(graph):
                    outs = self.fn(list(static))
        except Exception as exc:                  # noqa: BLE001 - run without graphs instead
            log.warning("fusion-compiler: %s: CUDA graph capture failed (%s: %s); running "
                        "without CUDA graphs", self.name, type(exc).__name__, exc)
            self.disabled = True
            return self.fn(args)
        self.graph, self.outs = graph, outs
        # what each handed-out output is made from: the same memory and layout on every replay
        self.alias_meta = [(i, _alias_meta(o)) for i, o in enumerate(outs)
                           if isinstance(o, torch.Tensor)]
        self.stable = [(i, a.data_ptr()) for i, (a, k) in enumerate(zip(args, keep))
                       if k and isinstance(a, torch.Tensor)]
        self.copied = [(i, s) for i, (s, k) in enumerate(zip(static, keep))
                       if not k and isinstance(s, torch.Tensor)]
        return self._replay()

    def _replay(self):
        if self.copy_outputs:
            self.graph.replay()
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.outs]
        _mark_stale(self.handed)        # about to be overwritten: reading them now raises
        self.graph.replay()
        outs = list(self.outs)
        for i, meta in self.alias_meta:
            outs[i], storage = _alias(meta)
            self.handed.append(storage)
        return outs


_SIDE_STREAMS: dict = {}


def _side_stream(args) -> torch.cuda.Stream:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)),
                  torch.device("cuda", torch.cuda.current_device()))
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


_CLEAR_CUBLAS = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)


@contextlib.contextmanager
def _own_cublas_workspace():
    """Around a capture: cuBLAS's cached workspaces are dropped before and after, as Inductor's
    CUDA graph trees do (``clear_cublas_manager``). Before: the capture allocates a workspace of
    its own, in the graph's private pool, instead of baking in the address of one that eager
    work or another graph shares, and that torch may free while this graph still replays
    (pytorch/pytorch#193402). After: no later call on the capture stream is handed memory of
    this graph's pool. A dropped eager workspace is allocated again by the next cuBLAS call."""
    _CLEAR_CUBLAS()
    try:
        yield
    finally:
        _CLEAR_CUBLAS()


def _mark_stale(handed: list) -> None:
    """Mark storages handed out: reading them, through any tensor, raises ``STALE``. The mark
    is on the storage, not on a tensor (``_set_storage_access_error_msg`` marks one tensor, and
    a view taken before read overwritten values without an error on the H200)."""
    for storage in handed:
        torch._C._set_storage_data_ptr_access_error_msg(storage._cdata, STALE)
    handed.clear()


def _alias_meta(t: torch.Tensor) -> dict:
    storage = t.untyped_storage()
    return {"nbytes": storage.nbytes(), "data_ptr": storage.data_ptr(), "size": t.shape,
            "stride": t.stride(), "dtype": t.dtype, "device": t.device,
            "storage_offset": t.storage_offset()}


def _alias(meta: dict):
    """(tensor, storage): a tensor over a graph output's memory (``_alias_meta``) with a
    storage object of its own: marking it stale leaves the graph's own tensor (and the other
    outputs) alone."""
    own = torch._C._construct_storage_from_data_pointer(meta["data_ptr"], meta["device"],
                                                        meta["nbytes"])
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, own), own
