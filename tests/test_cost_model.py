"""Cost model and priority fusion on small graphs: numbers checked by hand, order, vetoes.

The graphs are analysed only (shapes -> classify -> fuse); no kernel runs, so sizes can be
large where the bytes must dominate the launch overhead.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd

from fusion_compiler.backend import make_context
from fusion_compiler.config import Config
from fusion_compiler.decompositions import decomposition_table
from fusion_compiler.passes import pipeline
from fusion_compiler.passes.cost_model import PROFILES
from helpers import assert_close, compile_and_run, kernel_count

H200 = PROFILES["h200"]


def analyze(fn, *args, **config):
    """Run the analysis passes on the inference ATen graph of ``fn``; return the context."""
    contexts = []
    cfg = dataclasses.replace(Config.from_env(), **{"profile": "h200", **config})

    def compiler(gm, _inputs):
        ctx = make_context(cfg, "inference")
        pipeline.analyze(gm, ctx)
        contexts.append(ctx)
        gm.recompile()      # the passes rewrite the graph, not its code
        return gm

    backend = aot_autograd(fw_compiler=compiler, decompositions=decomposition_table())
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(contexts) == 1
    return contexts[0]


def ops_of(group):
    return sorted(str(n.target).split(".")[1] for n in group.members)


def test_bytes_and_launches_of_a_pointwise_chain():
    x = torch.randn(1000)
    ctx = analyze(lambda t: (t + 1.0) * 2.0, x)
    (g,) = ctx.groups
    assert ops_of(g) == ["add", "mul"]
    # unfused: add reads 4000 B, writes 4000 B; mul the same; fused: read x once, write once
    unfused = [ctx.unfused_cost[n] for n in g.members]
    assert sum(c.bytes for c in unfused) == 16000 and len(unfused) == 2
    assert g.cost.bytes_read == 4000 and g.cost.bytes_written == 4000
    # host 2.5 us > GPU 2 us + 8000 B / 4.22 TB/s: launch-bound
    assert abs(g.cost.time - max(H200.launch_overhead,
                                 H200.kernel_latency + 8000 / H200.hbm_bandwidth)) < 1e-15
    assert g.cost.time == H200.launch_overhead


def test_flops_and_further_outputs_by_hand():
    """time = max(launch + per_output * (outputs - 1),
                  latency + hypot(bytes / bw, flops / peak)):
    exp (2 FLOPs an element) + mul (1), two outputs; a peak low enough that the FLOPs bind, then
    the real one (the host binds), then a bandwidth low enough that the bytes bind."""
    import math

    from fusion_compiler.passes.cost_model import kernel_cost
    x = torch.randn(1000)
    def f(t):
        e = torch.exp(t)
        return e, e * 2.0
    ctx = analyze(f, x)
    (g,) = ctx.groups
    assert ops_of(g) == ["exp", "mul"] and len(g.outputs) == 2
    slow = dataclasses.replace(H200, peak_flops=2e8, launch_per_output=1e-6)
    cost = kernel_cost(g.inputs, g.outputs, 1, set(), ctx.size_hints, slow, g.members)
    assert cost.bytes == 12000
    expected = H200.kernel_latency + math.hypot(12000 / H200.hbm_bandwidth, 3000 / 2e8)
    assert abs(cost.time - expected) < 1e-15 and cost.time > 15e-6               # FLOPs bind
    fast = dataclasses.replace(H200, launch_per_output=1e-6)
    cost = kernel_cost(g.inputs, g.outputs, 1, set(), ctx.size_hints, fast, g.members)
    assert abs(cost.time - (H200.launch_overhead + 1e-6)) < 1e-15               # host binds
    big = dataclasses.replace(H200, launch_per_output=1e-6, hbm_bandwidth=1e9)  # bytes bind
    cost = kernel_cost(g.inputs, g.outputs, 1, set(), ctx.size_hints, big, g.members)
    expected = H200.kernel_latency + math.hypot(12000 / 1e9, 3000 / H200.peak_flops)
    assert abs(cost.time - expected) < 1e-15
    assert abs(cost.time - (H200.kernel_latency + 12000 / 1e9)) < 1e-9


def test_op_flops_weigh_each_op_by_its_instructions():
    """erf and tanh cost some 30 FLOPs an element (libdevice's polynomials), exp 2, an add 1,
    a view or cast 0; pow with an exponent the code generator writes as a product (3) or a
    square root (0.5) costs 2, with any other exponent (4) or a tensor one libdevice's powf."""
    from fusion_compiler.passes.cost_model import OP_FLOPS, POW_FLOPS, op_flops
    x = torch.randn(6, 10)

    def f(t):
        return (torch.erf(t), torch.tanh(t), torch.exp(t), t + 1, t.view(60),
                torch.pow(t, 3), torch.pow(t, t), torch.pow(t.abs(), 0.5), torch.pow(t, 4))
    ctx = analyze(f, x)
    flops = {n.target: op_flops(n, ctx.size_hints) for g in ctx.groups for n in g.members}
    pows = sorted(op_flops(n, ctx.size_hints) for g in ctx.groups for n in g.members
                  if n.target is torch.ops.aten.pow.Tensor_Scalar)
    assert pows == [120, 120, 60 * POW_FLOPS]         # exponents 3 and 0.5, then 4
    aten = torch.ops.aten
    assert flops[aten.erf.default] == 60 * OP_FLOPS["erf"] >= 60 * 30
    assert flops[aten.tanh.default] == 60 * OP_FLOPS["tanh"] >= 60 * 20
    assert flops[aten.exp.default] == 120 and flops[aten.add.Tensor] == 60
    assert flops[aten.pow.Tensor_Tensor] == 60 * POW_FLOPS
    assert flops.get(aten.view.default, 0) == 0


def test_each_further_input_costs_host_time():
    """host = launch + per_input * (inputs - 1): a sum of five tensors, launch-bound."""
    from fusion_compiler.passes.cost_model import kernel_cost
    xs = [torch.randn(100) for _ in range(5)]
    ctx = analyze(lambda a, b, c, d, e: a + b + c + d + e, *xs)
    (g,) = ctx.groups
    assert len(g.inputs) == 5
    per_input = dataclasses.replace(H200, launch_per_input=0.5e-6, launch_per_output=0.0)
    cost = kernel_cost(g.inputs, g.outputs, 1, set(), ctx.size_hints, per_input, g.members)
    assert abs(cost.time - (H200.launch_overhead + 4 * 0.5e-6)) < 1e-15


def test_bytes_of_add_rmsnorm_count_the_broadcast_weight_at_its_own_size():
    from patterns import add_rmsnorm
    x, r, w = torch.randn(7, 41), torch.randn(7, 41), torch.randn(41)
    ctx = analyze(add_rmsnorm, x, r, w)
    (g,) = ctx.groups
    # reads x, r (7*41*4 B each) and w (41*4 B); writes normed and h (7*41*4 B each)
    assert g.cost.bytes_read == 2 * 7 * 41 * 4 + 41 * 4
    assert g.cost.bytes_written == 2 * 7 * 41 * 4


def test_looped_reduction_counts_each_pass_over_the_row():
    from fusion_compiler.passes.cost_model import kernel_cost
    x = torch.randn(8, 4096)
    ctx = analyze(lambda t: torch.softmax(t, -1), x, max_persistent_block=1024,
                  max_resident_row=0)
    (g,) = ctx.groups
    rows = {n for n in g.inputs}
    # three passes (a LayerNorm's: the mean, the variance, the outputs): the row is read three
    # times from HBM without an L2 ...
    no_l2 = dataclasses.replace(H200, l2_bytes=0)
    cost = kernel_cost(g.inputs, g.outputs, 3, rows, ctx.size_hints, no_l2, g.members)
    assert cost.bytes_read == 3 * 8 * 4096 * 4
    assert cost.bytes_written == 8 * 4096 * 4
    # ... and once when the 128 KB re-read fits in half of it (the later passes hit L2)
    assert g.cost.bytes_read == 8 * 4096 * 4
    half = dataclasses.replace(H200, l2_bytes=2 * 8 * 4096 * 4)
    assert kernel_cost(g.inputs, g.outputs, 3, rows, ctx.size_hints, half,
                       g.members).bytes_read == 8 * 4096 * 4
    short = dataclasses.replace(H200, l2_bytes=2 * 8 * 4096 * 4 - 1)
    assert kernel_cost(g.inputs, g.outputs, 3, rows, ctx.size_hints, short,
                       g.members).bytes_read == 3 * 8 * 4096 * 4


@pytest.mark.parametrize("case, passes", [
    ("softmax", 2), ("log_softmax of a product", 2), ("layer_norm", 2), ("var_mean", 1),
    ("a third moment", 3), ("logsumexp", 1), ("softmax in bf16 ops", 3)])
def test_looped_passes_are_the_kernels(case, passes, monkeypatch):
    """The passes the cost model charges a looped kernel are the ones it makes: one a reduction
    level, one more for per-element outputs; a softmax's sum of exps (over fp32) is taken in its
    max's pass (the online softmax), a variance in its mean's (Welford's update), not a third
    moment. No L2 here: each pass reads the rows from HBM."""
    monkeypatch.setitem(PROFILES, "h200", dataclasses.replace(H200, l2_bytes=0))
    x = torch.randn(8, 4096)
    fns = {
        "softmax": lambda t: torch.softmax(t, -1),
        "log_softmax of a product": lambda t: torch.log_softmax(t * 2.0, -1),
        "layer_norm": lambda t: F.layer_norm(t, (4096,)),
        "var_mean": lambda t: torch.var_mean(t, -1),
        "a third moment": lambda t: (lambda d: d / (d * d * d).mean(-1, keepdim=True))(
            t - t.mean(-1, keepdim=True)),
        "logsumexp": lambda t: (t.amax(-1, keepdim=True)
                                + torch.exp(t - t.amax(-1, keepdim=True)).sum(-1, keepdim=True).log()),
        # exp(x - max) in bf16 (no upcast): the kernel keeps eager's roundings, in its own pass
        "softmax in bf16 ops": lambda t: (lambda e: e / e.sum(-1, keepdim=True))(
            torch.exp(t - t.amax(-1, keepdim=True))),
    }
    arg = x.bfloat16() if case == "softmax in bf16 ops" else x
    ctx = analyze(fns[case], arg, max_persistent_block=1024, max_resident_row=0)
    (g,) = ctx.groups
    assert g.cost.bytes_read == passes * 8 * 4096 * arg.element_size()


@pytest.mark.parametrize("rows, passes", [(8, 1), (132, 1), (131, 2)])
def test_resident_rows_are_read_once(rows, passes, monkeypatch):
    """A static row the resident kernel holds in registers is read once, where its rows are
    too many to split (132 on the H200's SMs; fewer: the split stages, two passes); without L2
    to absorb the looped kernel's second pass. 8 rows of 4096 make no two chunks of
    launch.SPLIT_MIN_CHUNK: not split either."""
    monkeypatch.setitem(PROFILES, "h200", dataclasses.replace(H200, l2_bytes=0))
    n = 4096 if rows == 8 else 16384
    x = torch.randn(rows, n)
    ctx = analyze(lambda t: torch.softmax(t, -1), x, max_persistent_block=1024)
    (g,) = ctx.groups
    assert g.cost.bytes_read == passes * rows * n * 4


def test_unprofitable_merge_is_refused_for_that_reason():
    """A looped LayerNorm reads its input twice; fusing a producer with four big inputs into it
    would read those twice (8 tensors) instead of writing and reading one tensor. The producer
    joins the statistics' pass, which stores its value in the same pass (the first pass stores
    what no reduction feeds): 4 read + 1 written, then the normalisation reads it (1 + 1)."""
    a, b, c, d = (torch.randn(4096, 4096) for _ in range(4))
    ctx = analyze(lambda a, b, c, d: F.layer_norm(a * b + c * d, (4096,)), a, b, c, d,
                  max_persistent_block=1024, max_resident_row=0)
    groups = sorted(ops_of(g) for g in ctx.groups)
    # the normalisation on its own, reading the stored producer
    assert ["add", "div", "mul", "rsqrt", "sub"] in groups, groups
    assert all(g.count("mul") < 3 or "rsqrt" not in g for g in groups), groups
    refused = [d for d in ctx.decisions if not d["taken"] and d["reason"].startswith("unprofitable")]
    assert any(d["bytes_after"] > d["bytes_before"] for d in refused), ctx.decisions


def test_higher_score_merge_is_taken_first():
    big, small = torch.randn(4096, 4096), torch.randn(64)
    ctx = analyze(lambda x, y: ((x + 1.0) * 2.0, (y + 1.0) * 2.0), big, small)
    taken = [d for d in ctx.decisions if d["taken"]]
    assert len(taken) == 2
    assert taken[0]["score_us"] > taken[1]["score_us"]
    assert taken[0]["bytes_before"] > taken[1]["bytes_before"]     # the big chain first


@pytest.mark.parametrize("profile", ["h100", "h200"])
def test_a_merge_waits_for_one_it_would_make_a_cycle_of(profile, device):
    """Channels-last bf16 batch statistics (chunks of a channel's N x H x W values: each one's
    mean, its squared deviations, Chan's term ``m2_i + t (mean_i - mean)^2`` with the batch's
    mean). Under the H200's prices the chunk's squared deviations with Chan's term (a launch
    saved) scored above them with the chunk's mean (x read once, not twice); taken first, it
    made the second a cycle (the term reads the batch mean, which the chunk means make), and
    x was read twice (ResNet-50's training step: 17 kernels more under the H200's profile than
    under the H100's, session 53). The first waits: under both profiles the mean and the
    squared deviations are one kernel, Chan's term joins the sum over the chunks, 6 kernels.
    On the device the kernels run on: CPU tensors keep ATen's batch norm where no kernel runs
    (a GPU machine's CPU, decompositions._kernels_run)."""
    x = torch.randn(128, 128, 28, 28, dtype=torch.bfloat16, device=device).contiguous(
        memory_format=torch.channels_last)
    w = (torch.rand(128, device=device) + 0.5).bfloat16()
    b = torch.randn(128, device=device).bfloat16()
    ctx = analyze(lambda x, w, b: F.relu(F.batch_norm(x, None, None, w, b, training=True)),
                  x, w, b, profile=profile)
    groups = sorted(ops_of(g) for g in ctx.groups)
    assert ["_to_copy", "mean", "mul", "sub", "sum"] in groups, groups
    assert ["add", "mul", "mul", "sub", "sum"] in groups, groups
    assert len(groups) == 6, groups
    assert not any(d["reason"].startswith("cycle") and d["bytes_before"] > 100e6
                   for d in ctx.decisions), ctx.decisions


def test_cycle_through_an_aten_op_is_vetoed():
    # p feeds c directly and through a matmul (ATen): fusing p and c would need the matmul
    # inside the kernel
    x, w = torch.randn(16, 16), torch.randn(16, 16)

    def fn(x, w):
        p = torch.exp(x)
        return p + p @ w
    ctx = analyze(fn, x, w)
    reasons = [d["reason"] for d in ctx.decisions if not d["taken"]]
    assert any(r.startswith("cycle") for r in reasons), ctx.decisions
    assert len(ctx.groups) == 2


def test_mismatched_iteration_spaces_are_vetoed():
    x = torch.randn(8, 16)

    def fn(x):
        m = x.amax(-1, keepdim=True)
        return (x - m).t().contiguous().sum(-1)       # second reduction over [16, 8]
    ctx = analyze(fn, x)
    refused = [d["reason"] for d in ctx.decisions if not d["taken"]]
    assert any("reduction" in r for r in refused), refused
    reductions = [n for g in ctx.groups for n in g.members if "amax" in str(n.target) or "sum" in str(n.target)]
    assert len(reductions) == len(set(reductions)) == 2      # each reduction in exactly one group


def test_group_size_limit_is_a_veto():
    x = torch.randn(100)
    ctx = analyze(lambda t: (((t + 1.0) * 2.0 - 3.0) / 4.0).exp(), x, max_group_ops=2)
    assert all(len(g.members) <= 2 for g in ctx.groups)
    assert any("max_group_ops" in d["reason"] for d in ctx.decisions if not d["taken"])


def test_every_decision_has_numbers_and_a_reason():
    from patterns import add_layernorm
    args = (torch.randn(7, 41), torch.randn(7, 41), torch.randn(41), torch.randn(41))
    ctx = analyze(add_layernorm, *args)
    assert ctx.decisions
    for d in ctx.decisions:
        assert d["reason"] and isinstance(d["score_us"], float)
        assert d["bytes_before"] > 0 and d["bytes_after"] > 0


def recompute_case(x):
    p = x.float() * 2.0                  # read by row reductions over it and over its transpose:
    return p.sum(-1), (p.t() * 3.0).amax(-1)    # two kernels that cannot be one


def test_cheap_producer_is_recomputed_in_each_consumer():
    ctx = analyze(recompute_case, torch.randn(64, 48, dtype=torch.bfloat16))
    taken = [d for d in ctx.decisions if d.get("kind") == "recompute" and d["taken"]]
    assert taken and all(d["bytes_after"] < d["bytes_before"] for d in taken)
    assert len(ctx.groups) == 2
    for g in ctx.groups:                  # p is computed in both kernels and written by neither
        assert {str(n.target).split(".")[1] for n in g.recomputed} & {"_to_copy", "mul"}
        assert not any(n in g.recomputed for n in g.outputs)


def test_recomputed_producer_runs_correctly(device):
    from helpers import assert_close, compile_and_run, kernel_count
    x = torch.randn(64, 48, dtype=torch.bfloat16, device=device)
    out, reports = compile_and_run(recompute_case, (x,))
    assert kernel_count(reports) == 2
    for a, e in zip(out, recompute_case(x)):
        assert_close(a, e)


def test_producer_read_by_aten_is_not_recomputed():
    x, w = torch.randn(16, 16), torch.randn(16, 16)

    def fn(x, w):
        p = x * 2.0
        return p.sum(-1), p.t() * 3.0, p @ w      # the matmul needs p in memory
    ctx = analyze(fn, x, w)
    assert not [d for d in ctx.decisions if d.get("kind") == "recompute" and d["taken"]]


def qk_norm(q, k, wq, wk):
    from patterns import rmsnorm
    return rmsnorm(q, wq), rmsnorm(k, wk)


def test_sibling_norms_reading_one_weight_share_a_kernel(device):
    """q-norm and k-norm of one shape: no path between them, one shared weight -> one launch."""
    from helpers import assert_close, compile_and_run, kernel_count
    q, k = torch.randn(2, 8, 4, 16, device=device), torch.randn(2, 8, 4, 16, device=device)
    w = torch.randn(16, device=device)
    out, reports = compile_and_run(qk_norm, (q, k, w, w))
    assert kernel_count(reports) == 1
    assert any(d.get("kind") == "horizontal" and d["taken"] for d in reports[0].decisions)
    for a, e in zip(out, qk_norm(q, k, w, w)):
        assert_close(a, e)


def test_each_part_of_a_multipart_kernel_pays_for_its_own_loads():
    """a * w over [2, 64] and b + w over [3, 64] share w: one launch of two parts, and each part
    loads w. Without an L2 in the profile ("generic") w's second read counts; on the H200 it
    fits in half the L2 and is free, as the looped kernels' re-reads are."""
    a, b, w = torch.randn(2, 64), torch.randn(3, 64), torch.randn(64)
    fn = lambda a, b, w: (a * w, b + w)  # noqa: E731
    for profile, read in (("generic", (2 + 3 + 1 + 1) * 64 * 4), ("h200", (2 + 3 + 1) * 64 * 4)):
        ctx = analyze(fn, a, b, w, profile=profile)
        (g,) = ctx.groups
        assert g.cost.bytes_read == read, profile
        assert g.cost.bytes_written == (2 + 3) * 64 * 4
        (taken,) = [d for d in ctx.decisions if d.get("kind") == "horizontal" and d["taken"]]
        assert taken["bytes_after"] == read + (2 + 3) * 64 * 4
        unfused = sum(ctx.unfused_cost[n].time for n in g.members)
        assert 0 < taken["score_us"] <= unfused * 1e6 - g.cost.time * 1e6 + 1e-9


def feeds_one_gemm(a, b):
    # relu(a) and sigmoid(b) read nothing in common; both feed the GEMM
    return torch.mm(a.relu() * 2.0, torch.sigmoid(b) + 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(5, 7, 3), (33, 17, 33)])
def test_siblings_feeding_one_op_share_a_launch(dtype, m, k, n, device):
    """Launch-bound siblings that share no input but feed one op are merged (into a multi-part
    kernel when their shapes differ): one kernel, not two."""
    from helpers import assert_close, compile_and_run, kernel_count

    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    out, reports = compile_and_run(feeds_one_gemm, (a, b))
    assert kernel_count(reports) == 1, reports[0].decisions
    (report,) = reports
    taken = [d for d in report.decisions if d.get("kind") == "horizontal" and d["taken"]]
    assert len(taken) == 1 and taken[0]["score_us"] > 0
    assert_close(out, feeds_one_gemm(a, b), dtype=dtype, atol=0.05 if dtype != torch.float32
                 else None, rtol=0.05 if dtype != torch.float32 else None)


def crossed_siblings(s, t, r, w1, w2):
    # a and d share s and t, b and c share s and r: the best sibling pairs. But a feeds c and b
    # feeds d through the GEMMs, so once {a, d} is one kernel, b -> d ... a -> c is a path from
    # b to c, and {b, c} would make a cycle of two kernels
    a, b = s * t, s * r
    c = (a @ w1) * s + r
    d = (b @ w2) * s + t
    return c, d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sibling_merges_that_would_make_a_cycle_are_refused(dtype, device):
    """Two sibling merges, each acyclic alone, that together make a cycle through ATen ops: the
    second is checked against the graph the first made, refused, and the model runs."""
    from helpers import assert_close, compile_and_run, kernel_count

    s, t, r = (torch.randn(37, 24, device=device, dtype=dtype) for _ in range(3))
    w1, w2 = (torch.randn(24, 24, device=device, dtype=dtype) for _ in range(2))
    out, reports = compile_and_run(crossed_siblings, (s, t, r, w1, w2))
    (report,) = reports
    assert not report.error
    taken = [d for d in report.decisions if d.get("kind") == "horizontal" and d["taken"]]
    assert len(taken) == 1 and set(taken[0]["producer"] + taken[0]["consumer"]) in (
        {"mul", "mul_3", "add_1"}, {"mul_1", "mul_2", "add"}), taken
    assert kernel_count(reports) == 3
    for a, e in zip(out, crossed_siblings(s, t, r, w1, w2)):
        assert_close(a, e, dtype=dtype, atol=0.05 if dtype != torch.float32 else None,
                     rtol=0.05 if dtype != torch.float32 else None)


def test_reduction_siblings_of_other_shapes_stay_apart():
    # GQA: 8 query heads, 2 key heads -> row reductions over different rows, one kernel each
    # (a multi-part kernel holds pointwise parts only)
    q, k, w = torch.randn(2, 8, 8, 16), torch.randn(2, 8, 2, 16), torch.randn(16)
    ctx = analyze(qk_norm, q, k, w, w)
    assert len(ctx.groups) == 2
    refused = [d for d in ctx.decisions if d.get("kind") == "horizontal" and not d["taken"]]
    assert refused and "must be pointwise" in refused[0]["reason"]


def test_pointwise_siblings_of_other_shapes_share_one_multipart_launch():
    # RoPE of q (8 heads) and of k (2 heads) read the same cos and sin: one launch, two parts
    from fusion_compiler.codegen.render import multipart_parts

    def rope2(q, k, cos, sin):
        def rope(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        return rope(q), rope(k)
    q, k = torch.randn(2, 8, 7, 16), torch.randn(2, 2, 7, 16)
    cos, sin = torch.randn(7, 16), torch.randn(7, 16)
    ctx = analyze(rope2, q, k, cos, sin)
    (g,) = ctx.groups
    parts = multipart_parts(g.ir)
    assert [list(sub.values[sub.outputs[0]].shape) for sub, _, _ in parts] == [
        [2, 8, 7, 16], [2, 2, 7, 16]]
    taken = [d for d in ctx.decisions if d.get("kind") == "horizontal" and d["taken"]]
    assert len(taken) == 1 and taken[0]["score_us"] > 0


def residual_stream(x, *ws):
    """A pre-norm residual stream as in a decoder: h = h + (rmsnorm(h) @ w), layer after layer.
    Each h feeds the next layer's RMSNorm and the next residual add, both fusion groups."""
    from patterns import rmsnorm
    h = x * 1.0
    for w in ws:
        h = h + rmsnorm(h, w[0]) @ w
    return h


def _launch_bound(monkeypatch):
    """A profile where every launch costs 8.5 us of host time and further inputs nothing (what
    one `calibrate` on the H200 measured): on bytes alone, recomputing looks free."""
    prof = dataclasses.replace(H200, name="launch-bound", launch_overhead=8.5e-6,
                               launch_per_input=0.0, launch_per_output=0.2e-6)
    monkeypatch.setitem(PROFILES, "launch-bound", prof)
    return "launch-bound"


def test_recompute_does_not_chain_along_a_residual_stream(monkeypatch):
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    ws = [torch.randn(64, 64, dtype=torch.bfloat16) for _ in range(6)]
    ctx = analyze(residual_stream, x, *ws, profile=_launch_bound(monkeypatch))
    refused = [d for d in ctx.decisions if d.get("kind") == "recompute" and not d["taken"]
               and "recomputed ops" in d["reason"]]
    assert refused and all(d["score_us"] > 0 for d in refused)     # it would have paid, alone
    for g in ctx.groups:
        adds = [n for n in g.recomputed if str(n.target) == "aten.add.Tensor"]
        assert len(adds) <= 1, f"group {g.id} recomputes {len(adds)} residual adds"
        # each kernel reads its layer's inputs, not every earlier layer's
        assert len(g.inputs) <= 4, f"group {g.id} reads {len(g.inputs)} tensors"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_stream_runs_correctly(device, dtype, monkeypatch):
    from helpers import assert_close, compile_and_run, kernel_count
    monkeypatch.setenv("FUSION_COMPILER_PROFILE", _launch_bound(monkeypatch))
    x = torch.randn(37, 24, dtype=dtype, device=device)
    ws = [torch.randn(24, 24, dtype=dtype, device=device) / 5 for _ in range(4)]
    out, reports = compile_and_run(residual_stream, (x, *ws))
    # per layer an RMSNorm kernel, and the last residual add: 4 layers, 5 kernels
    assert kernel_count(reports) == 5
    assert_close(out, residual_stream(x, *ws))


def test_graphs_replayed_from_cuda_graphs_are_costed_without_host_terms(monkeypatch):
    from fusion_compiler import backend, cudagraphs
    from fusion_compiler.passes.cost_model import without_host
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    cfg = dataclasses.replace(Config.from_env(), profile="h200", cudagraphs=True)
    # a graph that cannot be captured (here: CPU tensors) keeps the host's launch costs
    monkeypatch.setattr(cudagraphs, "why_not", lambda g, kind, static=None: "a cpu tensor")
    assert backend.make_context(cfg, "inference", gm).profile == H200
    monkeypatch.setattr(cudagraphs, "why_not", lambda g, kind, static=None: None)
    replayed = backend.make_context(cfg, "inference", gm).profile
    assert replayed == without_host(H200) and replayed.name == "h200+cudagraphs"
    assert (replayed.launch_overhead, replayed.launch_per_output, replayed.launch_per_input) == (0, 0, 0)
    assert replayed.kernel_latency == H200.kernel_latency > 0
    assert replayed.hbm_bandwidth == H200.hbm_bandwidth
    # without graphs the option changes nothing
    plain = dataclasses.replace(cfg, cudagraphs=False)
    assert backend.make_context(plain, "inference", gm).profile == H200


@pytest.mark.parametrize("fn, shape, form", [
    (lambda t: t * 2.0 + 1.0, (8, 64), "pointwise"),
    (lambda t: torch.softmax(t, -1), (8, 64), "rows"),
    (lambda t: torch.softmax(t, -1), (132, 16384), "rows, held"),
    (lambda t: torch.softmax(t, -1), (131, 16384), "rows, 2 passes"),
    (lambda t: torch.var_mean(t, -1), (131, 16384), "rows, 1 pass")],
    ids=["pointwise", "persistent", "resident", "split", "split, one pass"])
def test_groups_name_their_kernels_form(fn, shape, form):
    """The form `dump` shows beside each group (its "form" column and JSON key): the one the
    cost model counts the bytes of."""
    ctx = analyze(fn, torch.randn(*shape), max_persistent_block=1024)
    (g,) = ctx.groups
    assert g.form == form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("source,kernels", [("transposed", 2), ("expanded", 1)])
def test_copy_read_across_the_grain_kept_apart(source, kernels, dtype, device, cache_dir,
                                               monkeypatch):
    """A copy of a small tensor whose last dim lies at a stride above 1 (a transpose) stays a
    kernel of its own in front of a larger reader once its strided reads cost more than a
    launch (priced high here); a copy of an expand (stride 0: one element read again) merges
    whatever the price."""
    monkeypatch.setattr("fusion_compiler.passes.groups.STRIDED_READ_TIME", 1e-6)
    torch.manual_seed(3)
    x = torch.randn(37, 33, device=device, dtype=dtype)
    v = torch.randn(5, 33, device=device, dtype=dtype)

    def fn(x, v):
        w = v.t() if source == "transposed" else v[0, :, None].expand(33, 5)
        w = w.contiguous()
        return (x[:, :, None] * w).sigmoid()
    out, reports = compile_and_run(fn, (x, v))
    assert kernel_count(reports) == kernels, [r.decisions for r in reports]
    apart = [d for r in reports for d in r.decisions if "across its grain" in d["reason"]]
    assert bool(apart) == (kernels == 2)
    assert_close(out, fn(x, v), dtype=dtype)
