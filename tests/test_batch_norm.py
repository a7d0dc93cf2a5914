"""BatchNorm and InstanceNorm (decompositions: PyTorch's batch norm forms, var_mean over leading
and trailing dims in Chan's form; passes/outer_dims.py; codegen/lower.one_a_row).

In eval mode a batch norm is a per-channel scale and shift: one kernel with what surrounds it
(ReLU, a residual add). In training its statistics take a row kernel over [N x C] rows of H x W
elements (each row's mean and squared deviations, x read once), a small kernel that combines
them over N (mean, variance, rstd, the running statistics), and the output's kernel; its
backward the same three. Kernel counts and values against eager (gradients against float64's,
as close as eager's), odd sizes, channels-last, each dtype with its tolerance."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fusion_compiler import decompositions
from helpers import (TOL, aten_reasons, assert_close, compile_and_run, kernel_count,
                     leftover_aten)
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _stats(c, dtype, device):
    """weight, bias, running mean, running var (positive) for ``c`` channels."""
    w, b = randn((c,), dtype, device), randn((c,), dtype, device)
    return w, b, randn((c,), dtype, device) / 4, randn((c,), dtype, device).abs() + 0.5


def _layout(x, channels_last):
    if not channels_last:
        return x
    return x.to(memory_format={4: torch.channels_last, 5: torch.channels_last_3d}[x.dim()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_eval_batch_norm_relu_and_residual_are_one_kernel(dtype, channels_last, device):
    x = _layout(randn((3, 5, 7, 9), dtype, device), channels_last)
    r = _layout(randn((3, 5, 7, 9), dtype, device), channels_last)
    w, b, rm, rv = _stats(5, dtype, device)

    def f(x, r, w, b, rm, rv):
        return F.relu(F.batch_norm(x, rm, rv, w, b, training=False, eps=1e-3) + r)
    out, reports = compile_and_run(f, (x, r, w, b, rm, rv))
    expected = f(x, r, w, b, rm, rv)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for rep in reports for k in rep.kernels] == ["batchnorm"]
    assert out.stride() == expected.stride()        # ATen's memory format
    assert_close(out, expected, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, channels_last, kernels", [
    ((4, 6, 5, 7), False, 3), ((4, 6, 5, 7), True, 1), ((8, 6, 8, 8), True, 3),
    ((3, 6, 11), False, 3), ((2, 6, 3, 4, 5), True, 1)],
    ids=["nchw", "nhwc", "nhwc-split", "ncl", "ncdhw-last"])
def test_training_statistics(dtype, shape, channels_last, kernels, device):
    """Training mode under no_grad: the batch's statistics, the running ones updated in place
    (momentum 0.1, the variance unbiased) as eager updates them. NCHW: each (n, c) row's mean
    and squared deviations; their combination over N with the running statistics; the output
    with its ReLU. Channels-last: the rows are a channel's N x H x W values, C apart, in
    chunks of at least 128 (decompositions.splits): one chunk, one kernel for all of it; two
    (512 values), the chunks' statistics, their combination and the output."""
    x = _layout(randn(shape, dtype, device) * 2 + 0.5, channels_last)
    w, b, rm, rv = _stats(6, dtype, device)
    ours, theirs = (rm.clone(), rv.clone()), (rm.clone(), rv.clone())

    def f(x, w, b, rm, rv):
        return F.relu(F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1))
    with torch.no_grad():
        out, reports = compile_and_run(f, (x, w, b, *ours))
        expected = f(x, w, b, *theirs)
    assert kernel_count(reports) == kernels and leftover_aten(reports) == []
    assert out.stride() == expected.stride()
    assert_close(out, expected, dtype=dtype)
    assert_close(ours[0], theirs[0], dtype=dtype, name="running mean")
    assert_close(ours[1], theirs[1], dtype=dtype, name="running var")


def test_training_statistics_of_rows_without_trailing_dims(device):
    """BatchNorm1d over [N, C]: means over the leading dim, column sums (passes/column_sums):
    the mean, the variance, the running statistics and the output are per column of the
    rows [C, N], one kernel."""
    x = randn((37, 6), torch.float32, device)
    w, b, rm, rv = _stats(6, torch.float32, device)
    ours, theirs = (rm.clone(), rv.clone()), (rm.clone(), rv.clone())

    def f(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=True)
    with torch.no_grad():
        out, reports = compile_and_run(f, (x, w, b, *ours))
        expected = f(x, w, b, *theirs)
    assert leftover_aten(reports) == []
    assert kernel_count(reports) == 1
    assert_close(out, expected, dtype=torch.float32)
    assert_close(ours[1], theirs[1], dtype=torch.float32, name="running var")


class Block(torch.nn.Module):
    """A ResNet basic block: conv, BN, ReLU, conv, BN, the residual, ReLU."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_a_resnet_block_trains(dtype, channels_last, device):
    """Forward and backward of a training step: each BN's statistics, their combination and the
    output (with its ReLU, the residual) in three kernels, plus num_batches_tracked's add, as
    eager's; the backward the same three a BN, and the sum of x's two gradients (the
    residual's and the first convolution's). Output, running statistics
    and every gradient as close to float64's as eager's (within twice eager's error, or the
    dtype's tolerance). NCHW: the layout pass off (``channels_last``), which would otherwise
    run the block channels-last."""
    torch.manual_seed(0)
    base = Block(6).double().to(device)
    x64 = _layout(torch.randn(3, 6, 5, 7, dtype=torch.float64, device=device), channels_last)
    options = {} if channels_last else {"channels_last": False}

    def step(fn_of_model, dt):
        model = copy.deepcopy(base).to(dt)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        x = x64.to(dt).requires_grad_()
        out = fn_of_model(model)(x)
        out.double().square().sum().backward()
        return ([out, x.grad] + [p.grad for p in model.parameters()]
                + [b for b in model.buffers() if b.is_floating_point()])
    import fusion_compiler
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        got = step(lambda m: torch.compile(m, backend="fusion", options=options), dtype)
    eager, exact = step(lambda m: m, dtype), step(lambda m: m, torch.float64)
    assert leftover_aten(reports, "forward") == ["aten.convolution.default"] * 2
    assert leftover_aten(reports, "backward") == ["aten.convolution_backward.default"] * 2
    # channels-last: a BN's statistics, their combination and its output in one kernel over
    # rows of its channels' 105 values (one chunk), forward and backward; the two batch
    # counters in one kernel (fuse._graph_inputs_only)
    per_bn = 1 if channels_last else 3
    assert kernel_count(reports, "forward") == 2 * per_bn + 1
    assert kernel_count(reports, "backward") == 2 * per_bn + 1
    atol, rtol = TOL[dtype]
    names = ["output", "x grad"] + [n for n, _ in base.named_parameters()] + [
        n for n, b in base.named_buffers() if b.is_floating_point()]
    for a, e, r, name in zip(got, eager, exact, names):
        a, e, r = a.double(), e.double(), r.double()
        ours, theirs = (a - r).abs().max().item(), (e - r).abs().max().item()
        scale = r.abs().max().item()
        assert ours <= max(2 * theirs, atol + rtol * scale), \
            f"{name}: error {ours:.3g} against float64's, eager's {theirs:.3g}"
    assert got[0].stride() == eager[0].stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_instance_norm_and_a_batch_of_one(dtype, device):
    """InstanceNorm is a batch norm of [1, N x C, H, W], its weight repeated for each sample
    (decompositions.repeat: index arithmetic, no copy): over a leading dim of size 1 its
    statistics are the rows' own, one kernel; its backward two."""
    torch.manual_seed(0)
    norm = torch.nn.InstanceNorm2d(5, affine=True).to(device, dtype)
    with torch.no_grad():
        norm.weight.add_(1)
    x = randn((3, 5, 6, 7), dtype, device).requires_grad_()
    import fusion_compiler
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(lambda x: F.gelu(norm(x)), backend="fusion")(x)
        out.float().square().sum().backward()
    got = [x.grad, norm.weight.grad, norm.bias.grad]
    x.grad = norm.weight.grad = norm.bias.grad = None
    expected = F.gelu(norm(x))
    expected.float().square().sum().backward()
    assert leftover_aten(reports) == []
    assert [r.num_kernels for r in reports] == [1, 2]
    assert_close(out, expected, dtype=dtype)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for g, e, name in zip(got, [x.grad, norm.weight.grad, norm.bias.grad], ["x", "w", "b"]):
        assert_close(g, e, dtype=dtype, atol=tol * e.abs().max().item(), rtol=tol,
                     name=f"{name} grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_sums_over_leading_and_trailing_dims(dtype, channels_last, device):
    """sum(g * h, [0, 2, 3]) and mean(g, [0, 2, 3], keepdim) (a BN's weight and bias
    gradients): NCHW, rows over H x W in one kernel with the product, their sums over N in a
    second; fp32 in between, rounded once. Channels-last: column sums of the [N*H*W, C] view,
    both in one kernel (140 rows: one chunk)."""
    g = _layout(randn((4, 6, 5, 7), dtype, device), channels_last)
    h = _layout(randn((4, 6, 5, 7), dtype, device), channels_last)

    def f(g, h):
        return (g * h).sum([0, 2, 3]), g.mean([0, 2, 3], keepdim=True)
    (a, b), reports = compile_and_run(f, (g, h))
    ea, eb = f(g, h)
    assert leftover_aten(reports) == []
    assert kernel_count(reports) == (1 if channels_last else 2)
    assert_close(a, ea, dtype=dtype, name="sum")
    assert_close(b, eb, dtype=dtype, name="mean, keepdim")


def test_large_values_are_summed_in_fp32(device):
    """bf16 rows of ones with a large value each: partial sums rounded to bf16 would drift from
    eager's one rounding."""
    g = torch.ones(4, 3, 16, 16, dtype=torch.bfloat16, device=device)
    g[:, :, 0, 0] = 300.0
    out, reports = compile_and_run(lambda g: (g * 1).sum([0, 2, 3]), (g,))
    assert kernel_count(reports) == 2
    assert torch.equal(out, g.sum([0, 2, 3]))


def test_trailing_dims_that_do_not_merge_stay_on_aten_and_say_why(device):
    """A slice's rows with gaps (strides (210, 35, 5, 1), 4 of 5 columns): no view of one
    dimension in any order."""
    x = randn((4, 6, 7, 5), torch.float32, device)
    f = lambda x: (x * 2)[..., :4].sum([0, 2, 3])   # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == ["aten.sum.dim_IntList"]
    assert_close(out, f(x), dtype=torch.float32)
    assert aten_reasons(f, x) == [
        "reduction over leading and trailing dims: the trailing reduced dims are no view of one "
        "dimension (their strides)"]


def test_dynamic_shapes(device):
    """Symbolic sizes keep var_mean's plain form (its means over [0, 2, 3] on ATen): values as
    eager's for each shape."""
    for shape in ((2, 6, 4, 5), (3, 6, 7, 2)):
        x = randn(shape, torch.float32, device)
        w, b, rm, rv = _stats(6, torch.float32, device)
        f = lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
        out, _ = compile_and_run(f, (x, w, b), dynamic=True)
        assert_close(out, f(x, w, b), dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeat_is_read_by_index(dtype, device):
    """x.repeat(...) is index arithmetic in the kernel that reads it: one kernel, more repeats
    than dims too."""
    x, y = randn((3, 1, 5), dtype, device), randn((2, 6, 4, 10), dtype, device)
    f = lambda x, y: x.repeat(2, 2, 4, 2) * y      # noqa: E731
    out, reports = compile_and_run(f, (x, y))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x, y), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_repeat_is_a_new_contiguous_tensor(dtype, device):
    """``repeat`` returns a new contiguous tensor, as ATen's, also where its repeats leave the
    input's elements in place (a reshape alone would return a view with the input's strides):
    WavLM views its repeated position bias, a permuted tensor, and that view failed. A write
    into the result leaves the input as it was."""
    p = randn((5, 7, 4), dtype, device)
    f = lambda p: p.permute(2, 0, 1).unsqueeze(0).repeat(3, 1, 1, 1).view(12, 5, 7) * 2  # noqa: E731
    out, reports = compile_and_run(f, (p,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(p), dtype=dtype)

    x = randn((6, 9), dtype, device)
    out, reports = compile_and_run(lambda x: x.t().repeat(1, 1), (x,))
    assert kernel_count(reports) == 1
    assert out.stride() == (6, 1) and out.data_ptr() != x.data_ptr()
    assert torch.equal(out, x.t())

    def written(x):
        y = x.repeat(1, 1)
        y.add_(1)
        return y * 2

    before = x.clone()
    out, reports = compile_and_run(written, (x,))
    assert torch.equal(x, before)
    assert_close(out, written(before.clone()), dtype=dtype)


def test_cpu_without_the_interpreter_keeps_atens_batch_norm(monkeypatch):
    """No kernel runs on the CPU without Triton's interpreter: ATen's own batch norm stays,
    rather than its decomposition run op by op."""
    monkeypatch.setattr(decompositions, "interpreting", lambda: False)
    x = torch.randn(3, 5, 4, 7)
    w, b, rm, rv = _stats(5, torch.float32, "cpu")
    f = lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b)  # noqa: E731
    out, reports = compile_and_run(f, (x, w, b, rm, rv))
    assert any("batch_norm" in op for op in leftover_aten(reports))
    assert_close(out, f(x, w, b, rm, rv), dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_batch_counters_are_one_kernel(dtype, device):
    """Five BatchNorms in training: their ``num_batches_tracked + 1`` read only their own
    buffers and write one element each. They are one kernel (fuse._graph_inputs_only), each
    count written over its buffer (no ATen copy); after two steps every counter is 2, and the
    outputs, running statistics and gradients are as close to float64's as eager's."""
    import fusion_compiler

    # convolutions without biases, as before BatchNorms in ResNets: a bias there has a gradient
    # of 0 in exact arithmetic, and what rounding leaves of it is no measure (on the H100 in
    # session 53: 7.4e-5 against eager's 5.7e-6, float64's 3e-14)
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 6, 3, padding=1, bias=False)]
    for _ in range(5):
        layers += [torch.nn.BatchNorm2d(6), torch.nn.ReLU(), torch.nn.Conv2d(6, 6, 1, bias=False)]
    base = torch.nn.Sequential(*layers).double().to(device)
    models = {"ours": copy.deepcopy(base).to(dtype), "eager": copy.deepcopy(base).to(dtype),
              "exact": copy.deepcopy(base)}
    compiled = torch.compile(models["ours"], backend="fusion", options={"channels_last": False})
    outs = {}
    for step in range(2):
        x64 = torch.randn(3, 3, 7, 5, dtype=torch.float64, device=device)
        with fusion_compiler.capture_compiles() as reports:
            for name, fn in (("ours", compiled), ("eager", models["eager"]),
                             ("exact", models["exact"])):
                out = fn(x64.to(next(models[name].parameters()).dtype))
                out.double().square().sum().backward()
                outs[name] = out
        if step == 0:
            # the kernels whose outputs are single elements
            groups = {g["id"]: g for r in reports if r.kind == "forward"
                      for g in r.summary["groups"]}
            counters = [k for r in reports if r.kind == "forward" for k in r.kernels
                        if all(math.prod(o["shape"]) == 1 for o in groups[k["group"]]["outputs"])]
            assert all(set(k["ops"]) == {"aten.add.Tensor"} for k in counters), counters
            assert len(counters) == 1 and len(counters[0]["ops"]) == 5, counters
            assert "aten.copy_.default" not in leftover_aten(reports, "forward")
            # each BatchNorm's statistics, their combination, its normalisation with ReLU
            assert kernel_count(reports, "forward") == 16
    atol, rtol = TOL[dtype]

    def close(ours, eager, exact, what):
        err = (ours.double() - exact.double()).abs().max().item()
        eager_err = (eager.double() - exact.double()).abs().max().item()
        assert err <= max(2 * eager_err, atol + rtol * exact.abs().max().item()), \
            f"{what}: error {err:.3g} against float64's, eager's {eager_err:.3g}"
    close(outs["ours"], outs["eager"], outs["exact"], "output")
    named = {k: dict(m.named_buffers()) for k, m in models.items()}
    for name, value in named["ours"].items():
        if "num_batches_tracked" in name:
            assert value.item() == named["eager"][name].item() == 2, name
        else:
            close(value, named["eager"][name], named["exact"][name], name)
    params = {k: dict(m.named_parameters()) for k, m in models.items()}
    for name, p in params["ours"].items():
        close(p.grad, params["eager"][name].grad, params["exact"][name].grad, f"{name} grad")
