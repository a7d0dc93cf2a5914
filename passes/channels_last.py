"""Run a convolution network's activations in channels-last memory (Dynamo graph, pre-ATen).

cuDNN's convolution kernels on Hopper and Ampere compute in NHWC. Handed NCHW (contiguous)
activations, ATen's convolution transposes its input into NHWC and its output back, each a
read and a write of the whole activation; the backward does the same for the incoming gradient
and the input it saves. On ResNet-50's training step (H200, bf16, batch 128) those transposes
were 6.3 ms of 26.5 ms of kernels (226 kernels, session 46), more than the fused kernels took.

The rewrite: each conv2d's input becomes ``x.contiguous(memory_format=torch.channels_last)``,
which costs nothing where ``x`` is channels-last already. The first convolution's input is
copied once; every convolution's output is then channels-last (ATen picks the format of its
input), every elementwise op and norm after it keeps its input's layout, and so the next
convolution's input is channels-last without a copy, and so are the backward's gradients.
Outputs of the graph are copied back to the layout eager PyTorch gives them, so callers see
the strides they always saw. A global average pool (``adaptive_avg_pool2d(x, 1)``) becomes the
mean over H and W that ATen computes for it: ATen then restrides a channels-last result's
size-1 dimensions with ``as_strided_``, which the backward pays for with a scatter into zeros.

Whether to: Inductor's layout rules for inference (torch/_inductor/graph.py,
``decide_layout_opt``), measured by its authors over torchbench's convolutions, and ours:

- no rewrite with dynamic shapes (Inductor saw regressions) or with fewer than 4-D inputs;
- ours: no rewrite of a graph with one convolution. Its input is copied channels-last and its
  output written back in eager's layout (or read by NCHW code after it): about the reads and
  writes of the two transposes cuDNN would make, so nothing to win, and the NCHW kernels of
  such graphs were measured (benchmarks/channels_first.py: LayerNorm2d after a 1 x 1
  convolution, 98.5 us against Inductor's channels-last 175.6 us, session 45);
- the convolutions' FLOPs weighted by the measured slowdown of channels-last for their kind
  (grouped with more than one input channel a group 1.358, at most 64 channels in and out
  0.783, at least twice as many input channels as output with a kernel larger than 1 x 1
  0.725, others 0.823); rewrite where the weighted sum is at most the plain one;
- ours: no rewrite of graphs with group or instance norm (statistics over H and W per group
  of channels) or with more than one mean or sum over H and W (a global pool once, at the end,
  is cheap): our kernels reduce those as rows, which channels-last puts C elements apart.
  Batch statistics and other sums over [0, 2, 3] are column sums of the [N*H*W, C] view
  (decompositions.var_mean_correction, outer_dims), whose chunks' rows lie side by side: the
  strided rows of ``launch.row_settings`` (``statements.strided_rows``, also where a chunk's
  H x W positions are split into digits). So training graphs and batch norm with batch
  statistics are rewritten. ResNet-50's training step (bf16, batch 128) took 25.5 ms
  channels-last against 31.5 ms NCHW on the H100 (session 50; session 46, before the
  column sums and strided rows: 34.6 ms against 27.3 on the H200, its row kernels 19.7 ms
  against 4.9).

The rewritten graph is run on fake tensors before it is kept: a view that channels-last strides
cannot give (``x.view(n, -1)`` of an NCHW activation) raises there, and the graph is restored.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


CONV2D = torch.conv2d               # is torch.nn.functional.conv2d
GROUPS = 6                          # conv2d(input, weight, bias, stride, padding, dilation, groups)
# channels-last time over contiguous time, by kind of convolution (Inductor's measurements)
SLOWDOWN = {"grouped": 1.358, "small": 0.783, "in_out": 0.725, "default": 0.823}
SMALL_CHANNELS = 64


@dataclass(frozen=True)
class Decision:
    convolutions: int
    applied: bool
    reason: str

    def note(self) -> str | None:
        """One line for reports, or None where the graph has no convolution."""
        if not self.convolutions:
            return None
        return f"{'channels-last' if self.applied else 'as traced'}: {self.reason}"


def _value(node):
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _groups(node) -> int:
    groups = node.kwargs.get("groups", node.args[GROUPS] if len(node.args) > GROUPS else 1)
    return groups if isinstance(groups, int) else 0


def _kind(weight: torch.Tensor, groups: int) -> str:
    out_ch, in_ch = weight.shape[0], weight.shape[1]        # in_ch: a group's
    if groups > 1 and in_ch > 1:
        return "grouped"
    if out_ch <= SMALL_CHANNELS and in_ch <= SMALL_CHANNELS:
        return "small"
    if out_ch * 2 <= in_ch and weight.shape[2] > 1:
        return "in_out"
    return "default"


def decide(convs: list, devices) -> Decision:
    """Whether the graph's conv2d calls ``convs`` should run channels-last (module docstring)."""
    n = len(convs)
    shapes = []
    for node in convs:
        x, w, out = _value(node.args[0]), _value(node.args[1]), _value(node)
        if x is None or w is None or out is None:
            return Decision(n, False, "a convolution's shapes are unknown")
        if x.dim() != 4:
            return Decision(n, False, "an unbatched (3-D) convolution input")
        if x.device.type not in devices:
            return Decision(n, False, f"convolutions on {x.device.type}")
        if any(isinstance(s, torch.SymInt) for t in (x, w, out) for s in t.shape):
            return Decision(n, False, "dynamic shapes (Inductor measured slowdowns there)")
        groups = _groups(node)
        if not groups:
            return Decision(n, False, "a convolution's groups are not a constant")
        shapes.append((_kind(w, groups), out.numel() * w[0].numel() * 2))
    if n < 2:
        return Decision(n, False, "one convolution (copying its input in and its output back "
                        "costs what cuDNN's transposes do)")
    graph = convs[0].graph
    stats = _per_channel_statistics(graph)
    if stats:
        return Decision(n, False, f"{stats} reduces H x W rows that channels-last strides")
    pools = _sums_over_height_and_width(graph)
    if len(pools) > 1:
        return Decision(n, False, f"{len(pools)} means or sums over H x W ({pools[0].name}, ...)"
                        " would read rows that channels-last strides")
    flops = sum(f for _, f in shapes)
    weighted = sum(f * SLOWDOWN[k] for k, f in shapes)
    ratio = weighted / flops if flops else 1.0
    return Decision(n, ratio <= 1.0, f"{n} convolutions, estimated time channels-last "
                    f"{ratio:.2f}x of contiguous")


def _arg(node, position: int, name: str, default=None):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _per_channel_statistics(graph) -> str | None:
    """The first op of ``graph`` computing statistics over H x W per channel, by name."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (F.group_norm, F.instance_norm):
            return node.target.__name__
    return None


REDUCTIONS = {"mean", "sum"}


def _sums_over_height_and_width(graph) -> list:
    """Nodes of ``graph`` taking a mean or sum over the last two dims of a 4-D tensor, and
    global average pools."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
            found.append(node)
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op not in ("call_method", "call_function") or name not in REDUCTIONS or \
                node.op == "call_function" and node.target not in (torch.mean, torch.sum):
            continue
        x, dims = _value(node.args[0]) if node.args else None, _arg(node, 1, "dim")
        if x is None or x.dim() != 4 or dims is None:
            continue
        dims = {d % 4 for d in (dims if isinstance(dims, (tuple, list)) else (dims,))
                if isinstance(d, int)}
        if {2, 3} <= dims:
            found.append(node)
    return found


def run(gm: torch.fx.GraphModule, devices=("cuda",)) -> Decision:
    """Rewrite ``gm`` (a Dynamo graph) as above where ``decide`` says so; the decision."""
    convs = list(gm.graph.find_nodes(op="call_function", target=CONV2D))
    if not convs:
        return Decision(0, False, "no convolution")
    decision = decide(convs, devices)
    if not decision.applied:
        return decision
    added = _rewrite(gm, convs)
    try:
        values = _propagate(gm)
        _restore_outputs(gm, values, added)
    except Exception as exc:        # noqa: BLE001 - the model's own ops reject the layout
        for node in reversed(added):
            node.replace_all_uses_with(node.meta.pop("replaces", node.args[0]))
            gm.graph.erase_node(node)
        return Decision(decision.convolutions, False,
                        f"the graph does not trace channels-last ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120]})")
    for node in added:
        if "replaces" in node.meta:
            gm.graph.erase_node(node.meta.pop("replaces"))
    for node, value in values.items():
        if node.graph is gm.graph:
            node.meta["example_value"] = value
    gm.recompile()
    return decision


def _rewrite(gm, convs) -> list:
    """The conversions before each convolution, and global average pools as means; the nodes
    added (to be undone if the graph does not trace)."""
    added = []
    for conv in convs:
        x = conv.args[0]
        with gm.graph.inserting_before(conv):
            node = gm.graph.call_method("contiguous", (x,),
                                        {"memory_format": torch.channels_last})
        conv.update_arg(0, node)
        added.append(node)
    for pool in list(gm.graph.find_nodes(op="call_function", target=F.adaptive_avg_pool2d)):
        x = pool.args[0] if pool.args else pool.kwargs.get("input")
        size = pool.args[1] if len(pool.args) > 1 else pool.kwargs.get("output_size")
        value = _value(x)
        if value is None or value.dim() != 4 or size not in (1, (1, 1), [1, 1]):
            continue
        with gm.graph.inserting_before(pool):
            mean = gm.graph.call_method("mean", (x, (-1, -2)), {"keepdim": True})
        mean.meta["replaces"] = pool
        pool.replace_all_uses_with(mean)
        added.append(mean)
    return added


def _fake_mode(gm):
    for node in gm.graph.find_nodes(op="placeholder"):
        mode = getattr(_value(node), "fake_mode", None)
        if mode is not None:
            return mode
    raise RuntimeError("no fake tensor among the graph's inputs")


def _propagate(gm) -> dict:
    """Each node's example value in the rewritten graph, from its inputs' (fake tensors). Grad
    mode is restored after (a graph may switch it, and may stop part way)."""
    env, values = {}, {}
    mode = _fake_mode(gm)
    load = lambda a: torch.fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
    with mode, torch.set_grad_enabled(torch.is_grad_enabled()):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = node.meta.get("example_value")
                continue
            if node.op == "get_attr":
                value = functools.reduce(getattr, node.target.split("."), gm)
                env[node] = mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
            elif node.op == "call_function":
                env[node] = node.target(*load(node.args), **load(node.kwargs))
            elif node.op == "call_method":
                self_, *rest = load(node.args)
                env[node] = getattr(self_, node.target)(*rest, **load(node.kwargs))
            elif node.op == "call_module":
                env[node] = gm.get_submodule(node.target)(*load(node.args), **load(node.kwargs))
            else:
                continue
            values[node] = env[node]
    return values


def _restore_outputs(gm, values, added) -> None:
    """Copy each tensor output whose strides the rewrite changed into eager's strides exactly
    (a size-1 dimension's stride too: a tangent with other strides than eager's output can
    cost the backward a copy)."""
    output = next(iter(gm.graph.find_nodes(op="output")))

    def restore(node):
        before, after = _value(node), values.get(node)
        if before is None or not isinstance(after, torch.Tensor) or \
                before.stride() == after.stride():
            return node
        for fmt in (torch.contiguous_format, torch.channels_last):
            with _fake_mode(gm):
                copy_value = after.clone(memory_format=fmt)
            if copy_value.stride() == before.stride():
                with gm.graph.inserting_before(output):
                    copy = gm.graph.call_method("clone", (node,), {"memory_format": fmt})
                values[copy] = copy_value
                added.append(copy)
                return copy
        raise ValueError(f"output {node.name}: the rewrite changed its strides "
                         f"{tuple(before.stride())}, which no memory format gives")

    output.args = torch.fx.node.map_arg(output.args, restore)
