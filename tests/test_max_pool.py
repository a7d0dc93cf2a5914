"""Max pooling (fusion_compiler/max_pool.py): max_pool2d_with_indices and its backward
decomposed into strided slices of the padded input, maximum and where, fused with what
computes the pool's input. Values and ATen's indices exactly as eager's (ties, NaN, -inf,
ceil_mode, dilation); kernel counts; gradients against float64's; the forward keeps a byte an
output value for the backward, not int64 indices nor the pool's input."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler import max_pool
from helpers import TOL, assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (input shape, kernel, stride, padding, dilation, ceil_mode)
GEOMETRIES = [
    ((2, 3, 13, 11), 3, 2, 1, 1, False),             # ResNet's stem pool, odd sizes
    ((2, 3, 8, 8), 2, 2, 0, 1, False),
    ((1, 2, 9, 7), 3, 1, 1, 1, False),               # overlapping windows, stride 1
    ((3, 5, 6), 3, 2, 1, 1, False),                  # unbatched [C, H, W]
    ((2, 3, 10, 9), (3, 2), (2, 1), (1, 0), 1, False),
    ((2, 3, 10, 9), 3, 2, 1, 1, True),
    ((1, 2, 12, 11), 3, 2, 1, 2, False),
    ((1, 2, 12, 11), 3, 2, 0, 2, True),
    ((1, 2, 11, 11), 2, 3, 1, 1, True),              # windows past the right padding
    ((2, 2, 7, 9), (2, 3), 2, 0, (2, 1), True),
]
IDS = [f"{'x'.join(map(str, g[0]))}-k{g[1]}-s{g[2]}-p{g[3]}-d{g[4]}{'-ceil' if g[5] else ''}"
       for g in GEOMETRIES]


def _args(k, s, p, d):
    return [max_pool._pair(v) for v in (k, s, p, d)]


def _hard_values(shape, dtype, device):
    """Integers (ties in every window), -inf and NaN among them."""
    x = (randn(shape, torch.float32, device) * 2).round().to(dtype)
    x.view(-1)[::7] = float("-inf")
    x.view(-1)[5::13] = float("nan")
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
def test_decomposition_is_atens_op(geometry, dtype):
    """The decompositions run eagerly give ATen's values and indices exactly, and its input
    gradient (summed in fp32 and rounded once: float64's rounded to the dtype)."""
    shape, k, s, p, d, ceil = geometry
    args = _args(k, s, p, d)
    x = _hard_values(shape, dtype, "cpu")
    values, indices = aten.max_pool2d_with_indices(x, *args, ceil)
    got_values, got_indices = max_pool.max_pool2d_with_indices(x, *args, ceil)
    assert torch.equal(got_indices, indices)
    assert torch.equal(got_values.isnan(), values.isnan())
    assert torch.equal(got_values.nan_to_num(), values.nan_to_num())
    grad = randn(values.shape, dtype, "cpu")
    got = max_pool.max_pool2d_with_indices_backward(grad, x, *args, ceil, indices)
    if dtype == torch.float32:
        assert_close(got, aten.max_pool2d_with_indices_backward(grad, x, *args, ceil, indices))
    else:
        exact = aten.max_pool2d_with_indices_backward(grad.double(), x.double(), *args, ceil,
                                                      indices)
        assert torch.equal(got, exact.to(dtype))


@pytest.mark.parametrize("geometry", [g for g in GEOMETRIES if max_pool._pair(g[4]) == (1, 1)],
                         ids=[i for i, g in zip(IDS, GEOMETRIES) if max_pool._pair(g[4]) == (1, 1)])
def test_backward_forms_agree(geometry):
    """Dilation 1: the form that reads the windows that may hold each element gives the same
    gradient as the one that spreads each window position's (both exact in fp32 sums of
    integers), and reads ceil(k / s) windows per dim, not k (4 comparisons for 3 x 3 at stride
    2, not 9)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    shape, k, s, p, d, ceil = geometry
    args = _args(k, s, p, d)
    x = _hard_values(shape, torch.float32, "cpu")
    values, indices = aten.max_pool2d_with_indices(x, *args, ceil)
    grad = randn(values.shape, torch.float32, "cpu").round()
    got = max_pool.max_pool2d_with_indices_backward(grad, x, *args, ceil, indices)
    geo = max_pool.geometry(x, *args, ceil)
    spread = max_pool._spread_windows(grad, x, geo[0], geo[1], geo[2], geo[3], geo[4], indices)
    assert torch.equal(got, spread)
    traced = make_fx(lambda g, i: max_pool.max_pool2d_with_indices_backward(
        g, x, *args, ceil, i))(grad, indices)
    compares = sum(n.target == aten.eq.Tensor for n in traced.graph.nodes)
    kh, kw = args[0]
    sh, sw = args[1]
    assert compares == -(-kh // sh) * -(-kw // sw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_eval_batch_norm_relu_and_pool_are_one_kernel(dtype, channels_last, device):
    """Inference: the pool reads its input through the normalisation and ReLU that compute it,
    in one kernel that writes only the pool's output (no index: nothing reads it)."""
    x = randn((3, 5, 13, 11), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = randn((5,), dtype, device), randn((5,), dtype, device)
    mean, var = randn((5,), dtype, device) / 4, randn((5,), dtype, device).abs() + 0.5

    def f(x, w, b, mean, var):
        y = F.relu(F.batch_norm(x, mean, var, w, b, training=False, eps=1e-3))
        return F.max_pool2d(y, 3, 2, 1)
    with torch.no_grad():
        out, reports = compile_and_run(f, (x, w, b, mean, var))
        expected = f(x, w, b, mean, var)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for rep in reports for k in rep.kernels] == ["batchnorm+maxpool"]
    assert_close(out, expected, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("geometry", [GEOMETRIES[0], GEOMETRIES[2], GEOMETRIES[5],
                                      GEOMETRIES[6]], ids=[IDS[0], IDS[2], IDS[5], IDS[6]])
def test_values_and_indices(geometry, dtype, device):
    """``return_indices=True``: both outputs of one kernel, the indices ATen's exactly."""
    shape, k, s, p, d, ceil = geometry
    x = _hard_values(shape, dtype, device)

    def f(x):
        return F.max_pool2d(x * 2, k, s, p, d, ceil_mode=ceil, return_indices=True)
    (values, indices), reports = compile_and_run(f, (x,))
    want_values, want_indices = f(x)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert torch.equal(indices, want_indices)
    assert_close(values, want_values, dtype=dtype)


def _saved_while(fn):
    """The tensors autograd keeps from the forward run by ``fn``: real ones (the layout pass
    runs the Dynamo graph on fake tensors while compiling, ATen's pool among its ops)."""
    from torch._subclasses.fake_tensor import FakeTensor
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, [t for t in saved if not isinstance(t, FakeTensor)]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_training_pool_gradients(dtype, channels_last, device, monkeypatch):
    """conv -> BatchNorm (batch statistics) -> ReLU -> pool -> conv, forward and backward:
    the pool fuses with the normalisation forward and with the BatchNorm's backward, nothing of
    it on ATen; every gradient as close to float64's as eager's (within twice eager's error, or the
    dtype's tolerance). The forward keeps the window
    position of each maximum in two bytes for the backward, not ATen's int64 indices, and not
    the normalised activations (the backward recomputes them from the convolution's output)."""
    # cuDNN takes TF32 for float32 convolutions by default, and picks it for these in
    # channels-last (eager's x grad there: 4.4e-4 from float64's, 8.6e-7 in NCHW; H100):
    # the comparison is of the kernels, in float32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), nn.Conv2d(6, 4, 1)).to(device)
    x64 = torch.randn(2, 3, 13, 11, dtype=torch.float64, device=device)

    def step(run, dt):
        model = copy.deepcopy(base).to(dt)
        x = x64.to(dt).clone().requires_grad_()
        out, saved = _saved_while(lambda: run(model)(x))
        out.float().square().sum().backward()
        return [out, x.grad] + [q.grad for q in model.parameters()], saved

    exact, _ = step(lambda m: m, torch.float64)
    eager, _ = step(lambda m: m, dtype)
    torch._dynamo.reset()
    options = {} if channels_last else {"channels_last": False}
    with fusion_compiler.capture_compiles() as reports:
        ours, saved = step(lambda m: torch.compile(m, backend="fusion", options=options), dtype)
    assert [r.error for r in reports if r.error] == []
    assert leftover_aten(reports, "forward") == ["aten.convolution.default"] * 2
    assert leftover_aten(reports, "backward") == ["aten.convolution_backward.default"] * 2
    # forward: the batch counter's add, statistics, their combination, normalisation + ReLU
    # + pool; on CUDA also the last conv's bias, which cuDNN's path adds after the conv
    # (passes/conv_bias.py: the first conv's joins the statistics' kernel; the last one's has
    # no reader in the graph); backward: the BatchNorm's three with the pool's gradient and
    # ReLU's inside
    # channels-last (the layout pass's choice for this graph): also the image's copy in and the
    # output's copy back to eager's layout, and the statistics as a column sum of chunks (two
    # kernels). On CUDA the last conv's bias add may join the output's copy or not: not yet
    # run there (session 50)
    if channels_last:
        counts = (6, 7) if device == "cuda" else (6,)
    else:
        counts = (5,) if device == "cuda" else (4,)
    assert kernel_count(reports, "forward") in counts, [r.num_kernels for r in reports]
    assert kernel_count(reports, "backward") == 3, [r.num_kernels for r in reports]
    pooled = (2, 6, 7, 6)
    kept = sorted((str(t.dtype), tuple(t.shape)) for t in saved if t.dim() == 4)
    assert ("torch.int16", pooled) in kept, kept
    assert not any(t.dtype == torch.int64 and t.dim() == 4 for t in saved), kept
    # the convolution's output, which the BatchNorm's backward reads; not the ReLU's too
    assert sum(tuple(t.shape) == (2, 6, 13, 11) for t in saved) == 1, kept
    names = ["output", "x grad"] + [n for n, _ in base.named_parameters()]
    atol, rtol = TOL[dtype]
    for name, o, e, x in zip(names, ours, eager, exact):
        ours_err = (o.double() - x).abs().max().item()
        eager_err = (e.double() - x).abs().max().item()
        assert ours_err <= max(2 * eager_err, atol + rtol * x.abs().max().item()), \
            f"{name}: error {ours_err:.3g} against float64's, eager's {eager_err:.3g}"


def test_symbolic_sizes_keep_atens_pool(device):
    """Dynamic shapes: ATen's pool, forward (values as eager's)."""
    x = randn((2, 3, 9, 10), torch.float32, device)

    def f(x):
        return F.max_pool2d(x + 1, 3, 2, 1)
    out, reports = compile_and_run(f, (x,), dynamic=True)
    assert leftover_aten(reports) == ["aten.max_pool2d_with_indices.default"]
    assert_close(out, f(x))


def test_wide_windows_keep_atens_pool(device):
    """Windows of over 25 positions (here 6 x 5) stay one ATen op, not 30 slices."""
    x = randn((2, 3, 12, 10), torch.float32, device)

    def f(x):
        return F.max_pool2d(x + 1, (6, 5))
    out, reports = compile_and_run(f, (x,))
    assert leftover_aten(reports) == ["aten.max_pool2d_with_indices.default"]
    assert_close(out, f(x))


def test_switched_off_keeps_atens_pool(device, monkeypatch):
    """``FUSION_COMPILER_MAX_POOL=0`` (bench's ``fusion-atenpool``): ATen's pool, forward and
    backward, the rest still fused; gradients as eager's."""
    monkeypatch.setenv("FUSION_COMPILER_MAX_POOL", "0")
    x = randn((2, 3, 9, 8), torch.float32, device).requires_grad_()

    def f(x):
        return F.max_pool2d(torch.relu(x * 2), 3, 2, 1)
    out, reports = compile_and_run(f, (x,))
    out.sum().backward()
    got, x.grad = x.grad, None
    f(x).sum().backward()
    assert leftover_aten(reports, "forward") == ["aten.max_pool2d_with_indices.default"]
    assert leftover_aten(reports, "backward") == ["aten.max_pool2d_with_indices_backward.default"]
    assert_close(out, f(x))
    assert_close(got, x.grad)


def test_atens_error_for_bad_padding(device):
    """Padding over half the window: ATen's own error, as eager raises it."""
    x = randn((1, 2, 8, 8), torch.float32, device)

    def f(x):
        return F.max_pool2d(x + 1, 2, 2, 2)
    with pytest.raises(Exception, match="pad should be at most half"):
        compile_and_run(f, (x,))
