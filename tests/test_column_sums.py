"""Sums over leading dimensions (bias and norm-weight gradients) as split row sums of a permuted
view (passes/column_sums.py), fused with their producers; the producer's own value stored where
the rows read it (codegen/row_outputs.py ``pulled``). Kernel counts and values against eager,
odd shapes, each dtype with its tolerance."""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.passes import column_sums
from helpers import TOL, assert_close, aten_reasons, compile_and_run, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fused_ops(reports):
    return [op for r in reports for k in r.kernels for op in k["ops"]]


def test_splits_make_chunks_of_at_least_128_rows():
    assert column_sums.splits(128) == 1
    assert column_sums.splits(255) == 1
    assert column_sums.splits(256) == 2
    assert column_sums.splits(300) == 2            # 150 rows a chunk; 75 would be too few
    assert column_sums.splits(4096) == 32
    assert column_sums.splits(4097) == 1           # odd: no power of two divides it


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [300, 129], ids=["split", "one-sum"])
def test_a_column_sum_fuses_with_its_producer(dtype, rows, device):
    """y = g * sigmoid(x) and y.sum(0), as a Linear's bias gradient after an activation's
    backward: y is stored by the kernel that sums it, computed once; split rows take a second,
    small kernel for the partial sums."""
    g, x = randn((rows, 37), dtype, device), randn((rows, 37), dtype, device)

    def f(g, x):
        y = g * torch.sigmoid(x)
        return y, y.sum(0)
    (y, s), reports = compile_and_run(f, (g, x))
    ey, es = f(g, x)
    assert leftover_aten(reports) == []
    assert kernel_count(reports) == (2 if rows == 300 else 1)
    assert fused_ops(reports).count("aten.sigmoid.default") == 1
    assert_close(y, ey, dtype=dtype, name="y")
    assert_close(s, es, dtype=dtype, name="sum")
    kernel, = [k for r in reports for k in r.kernels if "aten.sigmoid.default" in k["ops"]]
    with open(kernel["path"]) as source:
        assert source.read().count("tl.exp(") == 1      # y computed once, for its store and sum


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_sum_over_leading_dims_of_size_1_is_a_copy(dtype, device):
    """Sums and means over leading dims that are all of size 1 (a batch of one; a fuzzer's
    find, ``x.sum(0, keepdim=True)`` of a [1, 3] input, stayed on ATen): each is its input
    plus 0.0, in the kernel of what computes it, contiguous as ATen's result, its -0.0 summed to
    +0.0 as ATen's. Bit-equal to eager, signs of zeros included, keepdim or not, from a
    transposed input too."""
    x = randn((1, 1, 7, 5), dtype, device).transpose(-1, -2)
    x[0, 0, 0, 0] = -0.0
    for f in (lambda x: (x * 2).sum([0, 1]), lambda x: (x * 2).mean(0, keepdim=True),
              lambda x: x.sum([1, 0], keepdim=True), lambda x: x.mean([0, 1])):
        out, reports = compile_and_run(f, (x,))
        expected = f(x)
        assert leftover_aten(reports) == [] and kernel_count(reports) == 1
        assert torch.equal(out, expected)
        assert torch.equal(out.signbit(), expected.signbit())
        assert out.stride() == expected.stride() == out.contiguous().stride()
    # an empty dim list sums every dim: no copy (a first form of the rewrite took it for one)
    # but a full reduction, the product summed in its kernel
    out, reports = compile_and_run(lambda x: (x * 2).sum([]), (x,))
    assert out.shape == () and kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, (x * 2).sum([]), dtype=dtype)


FULL_REDUCTIONS = [
    ("sum()", lambda x: x.sum()), ("mean()", lambda x: x.mean()),
    ("amax()", lambda x: x.amax()), ("amin(keepdim)", lambda x: x.amin(list(range(x.dim())), True)),
    ("sum(all dims, keepdim)", lambda x: x.sum(list(range(x.dim()))[::-1], keepdim=True)),
    ("mean(all dims)", lambda x: x.mean(list(range(-x.dim(), 0)))),
]
FULL_INPUTS = {
    "1-d": lambda dtype, device: randn((37,), dtype, device),
    "2-d": lambda dtype, device: randn((5, 13), dtype, device),
    "transposed": lambda dtype, device: randn((3, 7, 9), dtype, device).transpose(0, 2),
    "split": lambda dtype, device: randn((3, 7001), dtype, device),     # 2 chunks of a row
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(FULL_INPUTS))
def test_a_full_reduction_is_a_row_kernel_with_its_producer(dtype, shape, device):
    """A reduction over every dim (a loss's ``sum()``, a per-tensor ``amax``) reduces its input
    viewed as one row in memory order, in the kernel that computes the input: one kernel, no
    ATen, each dtype within its tolerance of eager; an odd row of 21003 splits into chunks."""
    x, y = FULL_INPUTS[shape](dtype, device), FULL_INPUTS[shape](dtype, device)
    for name, red in FULL_REDUCTIONS:
        def f(x, y):
            return red(x * torch.sigmoid(y))
        out, reports = compile_and_run(f, (x, y))
        expected = f(x, y)
        assert leftover_aten(reports) == [] and kernel_count(reports) == 1, name
        assert "aten.sigmoid.default" in fused_ops(reports), name
        assert out.shape == expected.shape and out.dtype == expected.dtype, name
        assert_close(out, expected, dtype=dtype, name=f"{shape} {name}")


def test_full_reductions_keep_nan_and_leave_gapped_inputs_on_aten(device):
    """amax and sum of a row with a NaN give NaN, as eager's; an input with gaps in its memory
    (a slice of every other column) stays on ATen, a dtype argument too, with their reasons."""
    x = randn((6, 50), torch.float32, device)
    x[4, 17] = float("nan")
    for red in (lambda x: (x * 2).amax(), lambda x: (x * 2).sum(), lambda x: (x * 2).amin()):
        out, reports = compile_and_run(red, (x,))
        assert kernel_count(reports) == 1 and leftover_aten(reports) == []
        assert out.isnan().item() and red(x).isnan().item()
    cases = [(lambda x: x[:, ::2].sum(), "full reduction: its input has gaps or overlaps"),
             (lambda x: (x * 2).sum(dtype=torch.float64), "reduction of integers or with a dtype=")]
    for red, reason in cases:
        out, reports = compile_and_run(red, (x[:3],))
        assert leftover_aten(reports) == ["aten.sum.dim_IntList"]
        assert [r[:len(reason)] for r in aten_reasons(red, x[:3])] == [reason]
        assert_close(out, red(x[:3]), dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sums_over_two_leading_dims_with_keepdim(dtype, device):
    """A norm's weight gradient: sum(g * xhat, [0, 1]) over [B, T, C], and sum(g, [0, 1],
    keepdim=True): one kernel for both partial sums, one for both totals (siblings after one
    kernel, merged: passes/fuse.py ``_horizontal``)."""
    g, h = randn((4, 67, 29), dtype, device), randn((4, 67, 29), dtype, device)

    def f(g, h):
        return (g * h).sum([0, 1]), g.sum([0, 1], keepdim=True)
    (a, b), reports = compile_and_run(f, (g, h))
    ea, eb = f(g, h)
    assert leftover_aten(reports) == []
    assert kernel_count(reports) == 2
    assert_close(a, ea, dtype=dtype, name="sum(g * h)")
    assert_close(b, eb, dtype=dtype, name="sum(g, keepdim)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [300, 37], ids=["split", "one-sum"])
@pytest.mark.parametrize("dims", [[0], [0, 1]], ids=str)
def test_means_over_leading_dims(dtype, rows, dims, device):
    """A mean over leading dims (BatchNorm1d's statistics over [N, C]) is the column sum divided
    by the rows' count in fp32, rounded once; with keepdim too. Two means of one shape: one
    kernel, or two where the rows are split."""
    x = randn((rows, 3, 13), dtype, device) * 4 + 1

    def f(x):
        y = x * 2
        return y.mean(dims), (y * y).mean(dims, keepdim=True)
    (a, b), reports = compile_and_run(f, (x,))
    ea, eb = f(x)
    assert leftover_aten(reports) == []
    assert kernel_count(reports) == (2 if rows == 300 else 1)
    assert_close(a, ea, dtype=dtype, name="mean")
    assert_close(b, eb, dtype=dtype, name="mean of squares, keepdim")


def test_large_values_keep_fp32_partials(device):
    """The partial sums stay fp32 between the two kernels: bf16 partials of 2048 ones plus a
    large first value would each round, and their total would drift from eager's."""
    g = torch.ones(2048, 8, dtype=torch.bfloat16, device=device)
    g[::128] = 300.0
    out, reports = compile_and_run(lambda g: g.sum(0), (g,))
    assert kernel_count(reports) == 2
    assert torch.equal(out, g.sum(0))               # one rounding, as eager's


def test_a_sum_over_leading_dims_that_do_not_merge_stays_on_aten(device):
    """Leading dims that are no view of one dimension, in memory order too only with the kept
    ones transposed (passes/memory_order.py declines), are left alone: one kernel for the
    product, the sum on ATen."""
    g = randn((300, 8, 5, 16), torch.float32, device).permute(1, 0, 3, 2)
    out, reports = compile_and_run(lambda g: (g * 2).sum([0, 1]), (g,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == ["aten.sum.dim_IntList"]
    assert_close(out, (g * 2).sum([0, 1]), dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_and_layer_norm_gradients_have_no_sum_on_aten(dtype, device):
    """The backward of Linear + GELU + LayerNorm: the bias and norm-weight gradients are summed
    in kernels, none on ATen. Every gradient is as close to float64's as eager's is (within
    twice eager's error, or the dtype's tolerance): the norm's weight gradient reaches 1e3
    here, and eager's own fp32 error on it is 2e-4."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40).to(device, dtype)
    norm = torch.nn.LayerNorm(40).to(device, dtype)
    x = randn((3, 100, 24), dtype, device).requires_grad_()

    def f(x):
        return (norm(F.gelu(lin(x))) ** 2).sum()
    params = [x, lin.weight, lin.bias, norm.weight, norm.bias]

    def grads(fn, dt):
        for p in params:
            p.grad = None
        for m in (lin, norm):
            m.to(dt)
        xd = x.detach().to(dt).requires_grad_()
        fn(xd).backward()
        out = [xd.grad] + [p.grad for p in params[1:]]
        for m in (lin, norm):
            m.to(dtype)
        return [g.double() for g in out]
    import fusion_compiler
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        got = grads(torch.compile(f, backend="fusion"), dtype)
    eager, exact = grads(f, dtype), grads(f, torch.float64)
    assert leftover_aten(reports, "backward") == ["aten.mm.default"] * 2
    assert leftover_aten(reports, "forward") == ["aten.addmm.default"]
    # forward: the GELU, the norm and the square in a row kernel, the loss's full sum in a
    # second (a row of 12000, read back: it cannot join rows of 40); backward: the norm's and
    # the GELU's backward in one row kernel; the partial sums (300 rows in two chunks) of the
    # norm weight's, the norm bias's and the Linear bias's gradients, all read from that
    # kernel's results, in a second; their totals in a third
    assert [r.num_kernels for r in reports] == [2, 3]
    assert fused_ops(reports[1:]).count("aten.sum.dim_IntList") == 8
    atol, rtol = TOL[dtype]
    for a, e, r, name in zip(got, eager, exact, ["x", "weight", "bias", "norm weight",
                                                 "norm bias"]):
        ours, theirs = (a - r).abs().max().item(), (e - r).abs().max().item()
        scale = r.abs().max().item()
        assert ours <= max(2 * theirs, atol + rtol * scale), \
            f"{name} grad: error {ours:.3g} against float64's, eager's {theirs:.3g}"


def test_turned_off_the_sums_stay_on_aten(device, monkeypatch):
    """FUSION_COMPILER_COLUMN_SUMS=0: ATen's reduction, and the producer's kernel alone."""
    monkeypatch.setenv("FUSION_COMPILER_COLUMN_SUMS", "0")
    g, x = randn((300, 37), torch.float32, device), randn((300, 37), torch.float32, device)

    def f(g, x):
        y = g * torch.sigmoid(x)
        return y, y.sum(0)
    (y, s), reports = compile_and_run(f, (g, x))
    assert leftover_aten(reports) == ["aten.sum.dim_IntList"]
    assert kernel_count(reports) == 1
    assert_close(s, f(g, x)[1], dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_columns_apart_and_broadcast_inputs(dtype, device):
    """A transposed input (its columns R apart: each permuted row is contiguous) and an input
    broadcast along the summed dim (stride 0: each row sums one value R times) take the same
    rewrite; the values are eager's."""
    xt = randn((37, 300), dtype, device).t()                      # [300, 37], strides (1, 300)
    b = randn((1, 37), dtype, device)

    def f(xt, b):
        return (xt * 2).sum(0), b.expand(300, 37).sum(0)
    (a, c), reports = compile_and_run(f, (xt, b))
    ea, ec = f(xt, b)
    assert leftover_aten(reports) == []
    assert_close(a, ea, dtype=dtype, name="transposed")
    assert_close(c, ec, dtype=dtype, name="broadcast")


def test_float64_and_integer_sums_stay_on_aten(device):
    """fp64 reductions and integer sums are ATen's, as before."""
    x = torch.randn(300, 5, dtype=torch.float64, device=device)
    i = torch.randint(-9, 9, (300, 5), device=device)
    f = lambda x, i: ((x * 2).sum(0), (i * 2).sum(0))     # noqa: E731
    (a, b), reports = compile_and_run(f, (x, i))
    assert leftover_aten(reports).count("aten.sum.dim_IntList") == 2
    assert torch.equal(b, f(x, i)[1])
    assert_close(a, f(x, i)[0], dtype=torch.float64)


def test_dump_labels_the_column_sums(device):
    """dump's label says what a kernel of the rewrite is: the partial sums with their producer
    ("silu+column sum": y = g * sigmoid(g)), and the totals ("column sum")."""
    g = randn((300, 37), torch.float32, device)

    def f(g):
        y = g * torch.sigmoid(g)
        return y, y.sum(0)
    out, reports = compile_and_run(f, (g,))
    assert sorted(k["label"] for r in reports for k in r.kernels) == ["column sum",
                                                                        "silu+column sum"]
    assert_close(out[1], f(g)[1], dtype=torch.float32)


def test_dump_says_why_a_sum_over_leading_dims_stays_on_aten(device, monkeypatch):
    """An op left on ATen names its reason: a sum over dims that are no view of one, or with the
    rewrite turned off; a max over the leading dims is a reduction not over the last one."""
    g = randn((300, 8, 5, 16), torch.float32, device).permute(1, 0, 3, 2)
    x = randn((300, 16), torch.float32, device)
    assert aten_reasons(lambda g: (g * 2).sum([0, 1]), g) == [
        "sum or mean over leading dims: the summed dims are no view of one dimension (their strides)"]
    assert aten_reasons(lambda x: (x * 2).amax(0), x) == ["reduction not over the last dimension"]
    monkeypatch.setenv("FUSION_COMPILER_COLUMN_SUMS", "0")
    assert aten_reasons(lambda x: (x * 2).sum(0), x) == [
        "sum or mean over leading dims: column sums are off (FUSION_COMPILER_COLUMN_SUMS=0)"]
