"""passes/inplace.py and launcher.inplace_outputs: a pointwise kernel writes its output over an
input that dies with it (the memory a call needs, as Inductor's), and nowhere else."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, assert_outputs_close, compile_and_run, kernel_count

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _mlp(x, w1, w2):
    return F.gelu(x @ w1) @ w2


def _weights(dtype, device, k=37, n=75):
    return (torch.randn(k, n, device=device).to(dtype) / 6,
            torch.randn(n, k, device=device).to(dtype) / 9)


def _inplace(reports):
    return sum(r.inplace for r in reports)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_writes_over_the_gemm_output_it_reads(dtype, device):
    x = torch.randn(13, 37, device=device).to(dtype)
    w1, w2 = _weights(dtype, device)
    out, reports = compile_and_run(_mlp, (x, w1, w2))
    assert_outputs_close(out, _mlp(x, w1, w2))
    assert kernel_count(reports) == 1
    assert _inplace(reports) == 1
    (written,) = reports[0].summary["inplace"]
    assert written["output"] == 0 and written["over"] == "mm"
    from fusion_compiler.dump_format import render_table
    doc = {"target": "t", "graphs": [dict(reports[0].summary, kernels=reports[0].kernels,
                                          ran_kernels=True)],
           "options": {"device": "-", "dtype": None, "training": False, "dynamic": False,
                       "profile": "p", "code": False}}
    assert f"group {written['group']} over mm" in render_table(doc)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_gemm_output_read_at_another_shape_is_written_as_that_shape(dtype, device):
    """A Linear over [B, H, W, C] (ConvNeXt's MLP): the GEMM's [B*H*W, 4C] output is read by
    the GELU as [B, H, W, 4C]; the kernel writes over it, and its output has the GELU's
    shape, whether the graph returns it or the next Linear reads it."""
    lin1 = torch.nn.Linear(19, 75, device=device).to(dtype).requires_grad_(False)
    lin2 = torch.nn.Linear(75, 19, device=device).to(dtype).requires_grad_(False)
    x = torch.randn(2, 5, 3, 19, device=device).to(dtype)

    def returned(x):
        return F.gelu(lin1(x))

    def read_on(x):
        return lin2(F.gelu(lin1(x)))

    for fn in (returned, read_on):
        out, reports = compile_and_run(fn, (x,))
        assert out.shape == fn(x).shape
        assert_outputs_close(out, fn(x))
        assert kernel_count(reports) == 1
        assert _inplace(reports) == 1, fn.__name__


def test_the_launcher_returns_the_tensor_it_was_given(device):
    """What the graph's ``r0=`` does: the output is that input, overwritten with the result;
    without it, a fresh tensor and the input untouched."""
    x = torch.randn(13, 37, device=device)
    w1, w2 = _weights(torch.float32, device)
    _, reports = compile_and_run(_mlp, (x, w1, w2))
    path = reports[0].kernels[0]["path"]
    spec = importlib.util.spec_from_file_location("k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.INPLACE == {0: 0}
    h = x @ w1
    want = F.gelu(h)
    kept = h.clone()
    (fresh,) = module.launch(torch.device(device), h)
    assert fresh.data_ptr() != h.data_ptr() and torch.equal(h, kept)
    (over,) = module.launch(torch.device(device), h, r0=h)
    assert over is h
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(over, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_input_used_after_the_kernel_is_not_written(dtype, device):
    """The GEMM output also feeds an op after the GELU, is a graph output, or has a view read
    later: each keeps its memory, and every result is eager's."""
    x = torch.randn(13, 37, device=device).to(dtype)
    w1, w2 = _weights(dtype, device)

    def later_op(x, w1, w2):
        a = x @ w1
        return F.gelu(a) @ w2, a @ w2           # a read by the second GEMM after the kernel

    def returned(x, w1, w2):
        a = x @ w1
        return F.gelu(a) @ w2, a

    def view_returned(x, w1, w2):
        a = x @ w1
        return F.gelu(a) @ w2, a.view(-1)[::7]

    for fn in (later_op, returned, view_returned):
        out, reports = compile_and_run(fn, (x, w1, w2))
        assert_outputs_close(out, fn(x, w1, w2))
        assert kernel_count(reports) == 1
        assert _inplace(reports) == 0, fn.__name__


def test_graph_inputs_parameters_and_their_views_are_never_written(device):
    x = torch.randn(13, 37, device=device)
    lin = torch.nn.Linear(37, 37, device=device).requires_grad_(False)

    def on_input(x):
        return F.gelu(x) * 3

    def on_view(x):
        return torch.sigmoid(x.view(37, 13)) + 1

    def on_parameter(x):
        return x @ torch.tanh(lin.weight)

    for fn in (on_input, on_view, on_parameter):
        before = (x.clone(), lin.weight.detach().clone())
        out, reports = compile_and_run(fn, (x,))
        assert_outputs_close(out, fn(x))
        assert kernel_count(reports) == 1
        assert _inplace(reports) == 0, fn.__name__
        assert torch.equal(x, before[0]) and torch.equal(lin.weight, before[1])


def test_inputs_read_otherwise_than_elementwise_are_not_written(device):
    """A dead GEMM output read transposed, broadcast, or into another dtype: a program would
    read what another one wrote, or the output does not fit it."""
    x = torch.randn(37, 37, device=device)
    w = torch.randn(37, 37, device=device)

    def transposed(x, w):
        a = x @ w
        return (torch.relu(a) + a.t()) @ w

    def broadcast(x, w):
        # a row of the GEMM output read by every [37, 37] block; the ones, a factory kept as a
        # buffer after the partition, dead after the kernel and of the output's shape: written
        # over, every later call would read what the one before left there
        a = x @ w
        return torch.relu(a[0] + torch.ones(4, 37, 37, device=x.device))

    def narrower(x, w):
        return torch.sigmoid(x @ w).to(torch.bfloat16) @ w.bfloat16()

    for fn in (transposed, broadcast, narrower):
        out, reports = compile_and_run(fn, (x, w))
        assert_outputs_close(out, fn(x, w))
        assert_outputs_close(torch.compile(fn, backend="fusion")(x, w), fn(x, w))   # again
        assert kernel_count(reports) == 1
        assert _inplace(reports) == 0, fn.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_keeps_what_backward_saves(dtype, device):
    """The forward graph returns the GEMM output for the backward (GELU's derivative reads it):
    not written over; gradients as eager's."""
    x = torch.randn(13, 37, device=device).to(dtype)
    w1, w2 = (w.requires_grad_() for w in _weights(dtype, device))
    ref = [w.detach().clone().requires_grad_() for w in (w1, w2)]
    torch._dynamo.reset()
    import fusion_compiler
    with fusion_compiler.capture_compiles() as reports:
        torch.compile(_mlp, backend="fusion")(x, w1, w2).sum().backward()
    _mlp(x, *ref).sum().backward()
    atol, rtol = TOL[dtype]
    for got, want in zip((w1.grad, w2.grad), (ref[0].grad, ref[1].grad)):
        torch.testing.assert_close(got, want, atol=4 * atol, rtol=4 * rtol)
    forward = [r for r in reports if r.kind == "forward"]
    assert forward and forward[0].inplace == 0
    assert kernel_count(reports, "forward") >= 1


def _rms(h, w):
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype) * w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_norm_writes_its_sum_and_its_output_over_the_gemm_outputs_it_adds(dtype, device):
    """A persistent row kernel (each row loaded once, before anything is stored): add+RMSNorm
    over two GEMM outputs writes the residual sum over one and the norm over the other, and
    a LayerNorm, which reads its input in its mean too, writes over the GEMM output it
    normalises; a softmax over a GEMM output likewise."""
    x = torch.randn(13, 37, device=device).to(dtype)
    a, b = (torch.randn(37, 45, device=device).to(dtype) / 6 for _ in range(2))
    w = torch.randn(45, device=device).to(dtype)

    def add_rmsnorm(x, a, b, w):
        h = x @ a + x @ b
        return h @ a.t(), _rms(h, w) @ b.t()

    def layer_norm(x, a, b, w):
        return F.layer_norm(x @ a, (45,), w, w / 3) @ b.t()

    def softmax(x, a, b, w):
        return torch.softmax(x @ a, -1) @ b.t()

    for fn, written in ((add_rmsnorm, 2), (layer_norm, 1), (softmax, 1)):
        out, reports = compile_and_run(fn, (x, a, b, w))
        assert_outputs_close(out, fn(x, a, b, w))
        assert kernel_count(reports) == 1, fn.__name__
        assert _inplace(reports) == written, fn.__name__


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_softmax_writes_over_the_attention_scores_it_reads_at_another_shape(dtype, device):
    """BLOOM's attention: the [B*H, S, T] scores of a bmm, viewed [B, H, S, T], masked and
    softmaxed; the kernel writes the probabilities over the scores (its output a view of
    them at its shape), whether the graph returns them or the next bmm reads them."""
    q, k, v = (torch.randn(6, s, 16, device=device).to(dtype) for s in (9, 11, 11))
    mask = torch.rand(9, 11, device=device) < 0.3

    def probs(q, k):
        s = torch.bmm(q, k.transpose(1, 2)).view(2, 3, 9, 11) * 0.25
        return torch.softmax(s.masked_fill(mask, -1e4).float(), -1).to(q.dtype)

    def attention(q, k, v):
        return torch.bmm(probs(q, k).view(6, 9, 11), v)

    for fn, args in ((probs, (q, k)), (attention, (q, k, v))):
        out, reports = compile_and_run(fn, args)
        assert out.shape == fn(*args).shape
        assert_outputs_close(out, fn(*args))
        assert kernel_count(reports) == 1, fn.__name__
        assert _inplace(reports) == 1, fn.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_of_a_dynamic_length_are_written_over_only_where_they_fit(dtype, device):
    """A row length known only at run time: the module has the persistent kernel and the
    looped one, which reads each row once a pass and was not checked for writing over them.
    The launcher writes over the GEMM outputs only for rows the persistent kernel takes (here
    up to 64 elements); the results are eager's on both sides of that length."""
    def add_rmsnorm(x, a, b, w):
        h = x @ a + x @ b
        return h, _rms(h, w)
    torch._dynamo.reset()
    compiled = torch.compile(add_rmsnorm, backend="fusion", dynamic=True,
                             options={"max_persistent_block": 64})
    import fusion_compiler
    with fusion_compiler.capture_compiles() as reports:
        for n in (45, 101, 64, 65):
            x = torch.randn(13, 37, device=device).to(dtype)
            a, b = (torch.randn(37, n, device=device).to(dtype) / 6 for _ in range(2))
            w = torch.randn(n, device=device).to(dtype)
            assert_outputs_close(compiled(x, a, b, w), add_rmsnorm(x, a, b, w))
    assert len(reports) == 1 and kernel_count(reports) == 1
    assert _inplace(reports) == 2
    source = open(reports[0].kernels[0]["path"]).read()
    assert "_looped_kernel" in source and "<= 64 else" in source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_read_elsewhere_or_streamed_are_not_written(dtype, device):
    """A row kernel's input read at other addresses than its output's (a row rolled, rows of
    a transpose), an output of one value a row, and a row too long to hold (the looped kernel
    reads a row twice, and the launcher may pick it): each keeps its memory."""
    x = torch.randn(13, 37, device=device).to(dtype)
    a = torch.randn(37, 37, device=device).to(dtype) / 6
    long = torch.randn(3, 37, device=device).to(dtype)
    wide = torch.randn(37, 20001, device=device).to(dtype) / 6

    def rolled(x, a):
        return torch.softmax(torch.roll(x @ a, 5, -1), -1) @ a

    def transposed(x, a):
        return torch.softmax((x @ a).t(), -1) @ a[:13]

    def per_row(x, a):
        h = x @ a
        return h.float().pow(2).mean(-1) @ a[:13].float()

    def looped(x, a):
        return torch.softmax(x @ wide, -1)

    for fn, args in ((rolled, (x, a)), (transposed, (x, a)), (per_row, (x, a)),
                     (looped, (long, a))):
        out, reports = compile_and_run(fn, args)
        assert_outputs_close(out, fn(*args))
        assert kernel_count(reports) == 1, fn.__name__
        assert _inplace(reports) == 0, fn.__name__


@pytest.mark.parametrize("moved", ["roll", "flip", "select-sum", "transpose"])
def test_a_value_of_the_input_read_elsewhere_keeps_it_apart(moved, device):
    """The GEMM's output dies with the kernel, and the kernel reads a value computed from it
    at other positions than the one it writes (a roll, a flip, slices of a sum over a small
    dim unrolled, a transpose): writing over it would let one program read what another has
    already overwritten (before: wrong by hundreds, ``y + y.roll(32, 0)``). The output gets
    its own memory."""
    a, b = torch.randn(120, 16, device=device), torch.randn(16, 56, device=device)

    def f(a, b):
        t = a @ b
        y = t * 2
        if moved == "roll":
            return y + y.roll(32, 0)
        if moved == "flip":
            return y + y.flip(0)
        if moved == "select-sum":       # passes/middle_dims: 3 slices added, broadcast back
            z = (t.view(280, 3, 8)) * 2     # groups of 24 across the programs' blocks
            return z - z.sum(1, keepdim=True)
        return y[:56] + y[:56].t()
    out, reports = compile_and_run(f, (a, b))
    assert_outputs_close(out, f(a, b))
    assert kernel_count(reports) == 1
    assert _inplace(reports) == 0
