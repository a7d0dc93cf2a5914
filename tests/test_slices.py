"""A slice's gradient and slice assignment (fusion_compiler/slices.py): slice_backward as a
zero pad (a spread with a step), slice_scatter as a cat (a where with a step), and ``full``
as a constant of the kernel that reads it. Hugging Face's rotary embedding backward is one
kernel, not zeros, slice_scatters and an add on ATen; values as eager's, kernel counts."""
import pytest
import torch

import fusion_compiler
from fusion_compiler import slices
from helpers import assert_close, compile_and_run, kernel_count, leftover_aten
from patterns import randn

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BIG = 2 ** 63 - 1       # the end a traced ``x[k:]`` carries

# (input sizes, dim, start, end, step)
SLICES = [
    ((3, 10), 1, 0, 5, 1),
    ((3, 10), 1, 5, BIG, 1),
    ((4, 7, 9), 1, 0, BIG, 2),          # Swin's patch merging: every other row
    ((4, 7, 9), 2, 1, BIG, 2),
    ((5, 11), 0, 1, 4, 3),
    ((5, 11), -1, -4, None, 1),
    ((5, 11), 1, 2, 2, 1),              # empty
    ((6,), 0, None, -1, 4),
]


def _slice_len(n, start, end, step):
    return len(range(n)[slice(start, end if end != BIG else None, step)])


@pytest.mark.parametrize("case", SLICES, ids=str)
def test_decompositions_are_atens_ops(case):
    """Run eagerly: exactly ATen's slice_backward and slice_scatter (no arithmetic)."""
    sizes, dim, start, end, step = case
    d = dim % len(sizes)
    part = list(sizes)
    part[d] = _slice_len(sizes[d], start, end, step)
    grad = randn(tuple(part), torch.float32, "cpu")
    assert torch.equal(slices.slice_backward(grad, sizes, dim, start, end, step),
                       aten.slice_backward(grad, sizes, dim, 0 if start is None else start,
                                           BIG if end is None else end, step))
    base = randn(sizes, torch.float32, "cpu")
    got = slices.slice_scatter(base, grad, dim, start, end, step)
    assert torch.equal(got, aten.slice_scatter(base, grad, dim, start, end, step))
    assert got.data_ptr() != base.data_ptr()


def test_refusals_keep_atens_ops():
    """Different dtypes, a base with gaps (a permuted one is scattered: below), or sizes that
    do not match the slice: NotImplemented (traced as the op it is, ATen's checks and
    errors)."""
    base = randn((4, 6), torch.float32, "cpu")
    assert slices.slice_scatter(base, randn((4, 3), torch.float16, "cpu"), 1, 0, 3) \
        is NotImplemented
    assert slices.slice_scatter(randn((6, 8), torch.float32, "cpu")[:, ::2],
                                randn((3, 4), torch.float32, "cpu"), 0, 0, 3) is NotImplemented
    assert slices.slice_scatter(base, randn((4, 2), torch.float32, "cpu"), 1, 0, 3) \
        is NotImplemented
    assert slices.slice_backward(randn((4, 2), torch.float32, "cpu"), [4, 6], 1, 0, 3, 1) \
        is NotImplemented


def rotate_half(x):
    """Hugging Face's (Llama, Mistral, Qwen, Gemma): the halves of the head swapped, the second
    negated."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_backward_is_one_kernel(dtype, device):
    """Query and key through Hugging Face's rotary embedding, forward and backward: one kernel
    each way, nothing on ATen (before: the backward's four slice gradients were two ``full``s
    of zeros and four slice_scatters on ATen, and three kernels). Gradients as eager's."""
    q = randn((2, 3, 7, 10), dtype, device).requires_grad_()
    k = randn((2, 1, 7, 10), dtype, device).requires_grad_()
    cos, sin = randn((7, 10), dtype, device), randn((7, 10), dtype, device)
    (oq, ok), reports = compile_and_run(rope, (q, k, cos, sin))
    gq, gk = randn(oq.shape, dtype, device), randn(ok.shape, dtype, device)
    torch.autograd.backward([oq, ok], [gq, gk])
    got = q.grad, k.grad
    q.grad = k.grad = None
    wq, wk = rope(q, k, cos, sin)
    torch.autograd.backward([wq, wk], [gq, gk])
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "forward") == 1 and kernel_count(reports, "backward") == 1, \
        [(r.kind, r.num_kernels) for r in reports]
    assert_close(oq, wq, dtype=dtype)
    assert_close(ok, wk, dtype=dtype)
    assert_close(got[0], q.grad, dtype=dtype, name="q grad")
    assert_close(got[1], k.grad, dtype=dtype, name="k grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", [slice(2, 5), slice(1, None, 3), slice(0, 9)],
                         ids=["2:5", "1::3", "all"])
def test_slice_assignment_is_one_kernel(where, dtype, device):
    """``y[:, a:b:s] = z`` of a computed ``y`` (functionalized to slice_scatter): one kernel
    with what computes ``y`` and what reads the result, values exactly eager's."""
    x = randn((5, 9), dtype, device)
    z = randn((5, len(range(9)[where])), dtype, device)

    def f(x, z):
        y = x * 2
        y[:, where] = z
        return y + 1
    out, reports = compile_and_run(f, (x, z))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert torch.equal(out, f(x, z))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("then", ["scale", "norm"])
def test_strided_slices_backward(then, dtype, device):
    """Swin's patch merging: four strided slices of [B, H, W, C] concatenated on C, then a
    scale or a norm. The backward spreads each slice's gradient two apart on H and W, nothing
    on ATen (before: two ``full``s of zeros and eight slice_scatters): in the scale's backward
    kernel; after the norm's backward row kernel, in a second (a row kernel writes its rows
    where they are, not spread). Gradients as eager's."""
    x = randn((2, 6, 10, 3), dtype, device).requires_grad_()
    w = randn((12,), dtype, device)

    def merge(x, w):
        parts = [x[:, i::2, j::2, :] for i, j in ((0, 0), (1, 0), (0, 1), (1, 1))]
        y = torch.cat(parts, -1)
        return torch.nn.functional.layer_norm(y, (12,)) if then == "norm" else y * w
    out, reports = compile_and_run(merge, (x, w))
    g = randn(out.shape, dtype, device)
    out.backward(g)
    got, x.grad = x.grad, None
    merge(x, w).backward(g)
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "backward") == (2 if then == "norm" else 1), \
        [(r.kind, r.num_kernels) for r in reports]
    assert_close(got, x.grad, dtype=dtype, name="x grad")


@pytest.mark.parametrize("dtype", DTYPES + [torch.bool], ids=str)
def test_full_is_a_constant_of_its_reader(dtype, device):
    """``full`` read by a kernel is a literal of that kernel, in its dtype: no ATen op."""
    x = randn((3, 17), torch.float32, device)

    def f(x):
        c = torch.full((3, 17), True if dtype == torch.bool else 1.5, dtype=dtype, device=x.device)
        return torch.where(x > 0, x, c.to(x.dtype) * 2)
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert torch.equal(out, f(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, start, step", [(10, 1, 3), (2500, 1828, 3), (101, 4, 5)])
def test_a_flipped_slice_with_a_step_trains(n, start, step, dtype, device):
    """The gradient of ``x.flip(0)[start::step]``: the slice's gradient spread with its step,
    flipped, whose index ``(n - 1 - i - start) // step`` sympy splits into a constant and a
    division of ``-i``. Printed as it was, Triton's truncating ``//`` read the wrong elements of
    the gradient and past its end (a fuzzer's find: wrong by 9.6). One kernel forward, one
    backward, gradients as eager's."""
    x = randn((n,), dtype, device)

    def step_of(f):
        leaf = x.detach().clone().requires_grad_()
        out = f(leaf)
        (out.float() * torch.arange(1, out.numel() + 1, device=device)).sum().backward()
        return out, leaf.grad

    def f(x):
        return x.flip(0)[start::step] * 1.5
    expected = step_of(f)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        got = step_of(torch.compile(f, backend="fusion", fullgraph=True))
    assert [r.num_kernels for r in reports] == [1, 1] and leftover_aten(reports) == []
    assert_close(got[0], expected[0], dtype=dtype)
    assert_close(got[1], expected[1], dtype=dtype, name="x grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_slice_scatter_into_a_permuted_base(dtype, device):
    """A base whose dims are permuted in memory (Funnel's relative shift writes into one with
    its batch and head dims swapped) is scattered in its memory order and permuted back: one
    kernel with its producers, bit-equal to eager, with eager's strides (the base's). A base
    with gaps (a view into a larger one) stays ATen's."""
    b = randn((4, 2, 13, 25), dtype, device).permute(1, 0, 2, 3)
    s = randn((2, 4, 13, 13), dtype, device)
    cases = [(lambda b, s: torch.slice_scatter(b * 2, s * 3, 3, 0, 13), (b, s)),
             (lambda b, s: torch.slice_scatter(b * 2, s[..., :6] * 3, 3, 1, 13, 2), (b, s)),
             (lambda b, s: torch.slice_scatter(b + 1, s, 2, 8, None),
              (b.transpose(2, 3).contiguous().transpose(2, 3), randn((2, 4, 5, 25), dtype,
                                                                     device)))]
    for f, args in cases:
        out, reports = compile_and_run(f, args)
        expected = f(*args)
        assert kernel_count(reports) == 1 and leftover_aten(reports) == []
        assert torch.equal(out, expected) and out.stride() == expected.stride()
    gapped = randn((2, 4, 13, 26), dtype, device)[..., 1:]
    out, reports = compile_and_run(lambda b, s: torch.slice_scatter(b, s, 3, 0, 13), (gapped, s))
    assert leftover_aten(reports) == ["aten.slice_scatter.default"]
    assert torch.equal(out, torch.slice_scatter(gapped, s, 3, 0, 13))


def test_full_only_aten_reads_is_not_a_kernel(device):
    """A ``full`` only an ATen op reads (a GEMM's operand) is not a kernel of its own writing
    the constant on every call: it stays ``full``, made once (fast_calls)."""
    x = randn((4, 8), torch.float32, device)

    def f(x):
        return (x + 1) @ torch.full((8, 5), 0.25, device=x.device)
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1, [r.num_kernels for r in reports]
    assert "aten.full.default" in leftover_aten(reports)
    assert_close(out, f(x))


def test_symbolic_sizes(device):
    """Dynamic shapes (the sequence length symbolic): values and gradients as eager's, fused or
    not."""
    q = randn((2, 3, 7, 10), torch.float32, device).requires_grad_()
    k = randn((2, 1, 7, 10), torch.float32, device).requires_grad_()
    cos, sin = randn((7, 10), torch.float32, device), randn((7, 10), torch.float32, device)
    (oq, ok), reports = compile_and_run(rope, (q, k, cos, sin), dynamic=True)
    (oq.sum() + ok.square().sum()).backward()
    got = q.grad, k.grad
    q.grad = k.grad = None
    wq, wk = rope(q, k, cos, sin)
    (wq.sum() + wk.square().sum()).backward()
    assert [r.error for r in reports if r.error] == []
    assert_close(oq, wq)
    assert_close(got[0], q.grad, name="q grad")
    assert_close(got[1], k.grad, name="k grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(13, 37), (2, 5, 33)], ids=str)
def test_cross_entropy_backward_has_no_scatter(shape, dtype, device):
    """Cross entropy over logits in ``dtype`` (targets with an ignored -100 among them): the
    backward's one-hot of the targets (``scatter`` of -1 into zeros) is ``where(arange ==
    target)`` in the softmax backward's row kernel, one kernel in all, nothing on ATen (before:
    zeros, ATen's scatter, and a kernel reading it). Loss and gradient as eager's."""
    logits = randn(shape, dtype, device).requires_grad_()
    classes = shape[1]
    target = torch.randint(0, classes, shape[:1] + shape[2:], device=device)
    target[0] = -100

    def f(logits, target):
        return torch.nn.functional.cross_entropy(logits.float(), target)
    loss, reports = compile_and_run(f, (logits, target))
    loss.backward()
    got, logits.grad = logits.grad, None
    want = f(logits, target)
    want.backward()
    assert not {"aten.scatter.value", "aten.full.default"} & set(leftover_aten(reports)), \
        leftover_aten(reports)
    assert kernel_count(reports, "backward") == 1, [(r.kind, r.num_kernels) for r in reports]
    assert_close(loss, want, dtype=torch.float32, atol=1e-5, rtol=1e-5)
    assert_close(got, logits.grad, dtype=dtype, name="logits grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_backward_scatters_where_the_maximum_was(dtype, device):
    """``x.max(dim)``'s backward (``scatter`` of the gradient into zeros at the indices):
    ``where(arange == index, grad, 0)``, one backward kernel, gradients exactly eager's."""
    x = randn((3, 4, 9), dtype, device).requires_grad_()

    def f(x):
        return torch.max(x * 2, -1).values.float().square()
    out, reports = compile_and_run(f, (x,))
    g = randn(out.shape, torch.float32, device)
    out.backward(g)
    got, x.grad = x.grad, None
    f(x).backward(g)
    assert not {"aten.scatter.src", "aten.full.default"} & set(leftover_aten(reports))
    assert kernel_count(reports, "backward") == 1, [(r.kind, r.num_kernels) for r in reports]
    assert torch.equal(got, x.grad)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_decompositions_are_atens(dim):
    """Run eagerly: ATen's scatter of a value and of a source, one index per line along
    ``dim``, exactly; other index shapes (two per line, a shorter line) are NotImplemented."""
    base = randn((4, 5, 6), torch.float32, "cpu")
    shape = list(base.shape)
    shape[dim] = 1
    index = torch.randint(0, base.shape[dim], shape)
    src = randn(base.shape, torch.float32, "cpu")
    assert torch.equal(slices.scatter_value(base, dim, index, 2.5), base.scatter(dim, index, 2.5))
    assert torch.equal(slices.scatter_src(base, dim, index, src), base.scatter(dim, index, src))
    two = torch.cat([index, index], dim)
    assert slices.scatter_value(base, dim, two, 1.0) is NotImplemented
    assert slices.scatter_src(base, dim, index.narrow(dim - 1 if dim else 1, 0, 2), src) \
        is NotImplemented


@pytest.mark.parametrize("pad", [(-1, -2), (2, -1), (-1, 0, 1, -2), (0, 0, -3, 2, 1, 1),
                                 (-2, -2, -1, -1)], ids=str)
def test_negative_pads_are_atens(pad):
    """Run eagerly: a pad with negative amounts (a crop) is exactly ATen's."""
    x = randn((2, 3, 5, 6), torch.float32, "cpu")
    assert torch.equal(slices.constant_pad_nd(x, list(pad), 1.5),
                       aten.constant_pad_nd(x, list(pad), 1.5))
    assert slices.constant_pad_nd(x, [1, 2], 0) is NotImplemented      # no crop: ATen's op


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_pads_backward_is_in_the_kernel(dtype, device):
    """``F.pad``'s backward is a pad by the negated amounts (a crop): a slice in the kernel
    that reads it, one backward kernel, nothing on ATen (before: ATen's constant_pad_nd).
    Gradients exactly eager's."""
    x = randn((2, 3, 5, 7), dtype, device).requires_grad_()

    def f(x):
        return torch.nn.functional.pad(x * 2, (1, 2, 0, 3), value=0.5).float().square()
    out, reports = compile_and_run(f, (x,))
    g = randn(out.shape, torch.float32, device)
    out.backward(g)
    got, x.grad = x.grad, None
    f(x).backward(g)
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "backward") == 1, [(r.kind, r.num_kernels) for r in reports]
    assert_close(got, x.grad, dtype=dtype, name="x grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_causal_lm_loss_writes_the_padded_logits_gradient_once(dtype, device):
    """Cross entropy over ``logits[:, :-1]`` (next-token prediction, as examples/llama.py's
    CausalLMLoss): the logits' gradient is the sliced gradient padded back by one position,
    which a GEMM reads. The softmax backward's row kernel stores it inside the pad and its
    launcher zeroes the last position; before, a pad kernel copied all of it (at 4 x 1024
    tokens and 32000 classes, 262 MB read and written again)."""
    vocab = 37
    h = randn((2, 9, 16), dtype, device).requires_grad_()
    w = randn((16, vocab), dtype, device).requires_grad_()
    labels = torch.randint(0, vocab, (2, 9), device=device)

    def f(h, w, labels):
        logits = (h @ w)[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 labels[:, 1:].reshape(-1))
    loss, reports = compile_and_run(f, (h, w, labels))
    loss.backward()
    got = (h.grad, w.grad)
    h.grad = w.grad = None
    want = f(h, w, labels)
    want.backward()
    assert kernel_count(reports, "backward") == 1, [(r.kind, r.num_kernels) for r in reports]
    assert leftover_aten(reports, "backward") == ["aten.mm.default"] * 2
    src = open(next(r for r in reports if r.kind == "backward").kernels[0]["path"]).read()
    assert ".narrow(1, 8, 1).zero_()" in src
    assert_close(loss, want, dtype=torch.float32, atol=1e-5, rtol=1e-5)
    assert_close(got[0], h.grad, dtype=dtype, name="h grad")
    assert_close(got[1], w.grad, dtype=dtype, name="w grad")
    assert (got[0][:, -1] == 0).all()          # the padded position: no gradient


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pads, kernels", [((0, 0, 0, 1), 1), ((2, 0), 1), ((0, 0, 1, 0), 1),
                                           ((0, 0, 0, 0, 0, 2), 1), ((2, 3), 2),
                                           ((1, 0, 2, 1), 2)], ids=str)
def test_a_row_kernels_output_padded_with_zeros_is_stored_inside_the_pad(pads, kernels, dtype,
                                                                         device):
    """``F.pad(softmax(x) in another dtype, pads)`` as an output: padded on one side of one dim,
    one row kernel, the margin zeroed by its launcher (one fill), not a pad kernel reading the
    softmax back; padded on several sides, a pad kernel (one launch where the fills would be
    several)."""
    x = randn((5, 3, 19), dtype, device)
    out_dtype = torch.float32 if dtype != torch.float32 else torch.bfloat16
    f = lambda a: torch.nn.functional.pad(torch.softmax(a.float() * 2, -1).to(out_dtype),  # noqa: E731
                                          pads)
    out, reports = compile_and_run(f, (x,))
    want = f(x)
    assert kernel_count(reports) == kernels and leftover_aten(reports) == []
    assert_close(out, want, dtype=out_dtype)
    assert out.stride() == want.stride()


def _torch_2_11_scatter_meta(monkeypatch):
    """torch 2.11's fake slice/select/diagonal scatter (fixed by 2.13): the base's strides kept
    even where its elements share memory, as the GPU run that found the bug had them."""
    import torch._meta_registrations as meta
    from torch._prims_common import clone_preserve_strides
    if hasattr(meta, "_scatter_meta_output"):
        monkeypatch.setattr(meta, "_scatter_meta_output", clone_preserve_strides)


# op -> (f(x), kernels with static sizes, with symbolic sizes): x an expanded [5, 7], written
# into with its first row's part (symbolic sizes keep the slice's scatter on ATen, and the
# select's arange: slices.slice_scatter, the core table's select_scatter)
EXPANDED_SCATTERS = {
    "slice": (lambda x: torch.slice_scatter(x, x[:, 0:3] * 2, 1, 2, 5), 1, 2),
    "select": (lambda x: torch.select_scatter(x, x[0] * 2, 0, 3), 1, 1),
    "diagonal": (lambda x: torch.diagonal_scatter(x, x.diagonal(1) * 2, 1), 2, 2),
    "as_strided": (lambda x: torch.as_strided_scatter(x, x[0, 1:4] * 2, (3,), (8,), 2), 2, 2),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(EXPANDED_SCATTERS))
def test_a_scatter_into_an_expanded_base_writes_a_copy(op, dtype, dynamic, device, monkeypatch):
    """Found by the fuzzer on an H100 (torch 2.11): ``neg(slice_scatter(x, ...))`` of an
    expanded x read the scatter's dense output with the fake's stride of 0 and gave one element
    for all. The scatter now writes into a contiguous clone (slices.into_a_copy); its value and
    layout are eager's; with symbolic sizes too (the expanded dim's stride is still 0)."""
    _torch_2_11_scatter_meta(monkeypatch)
    scatter, static, symbolic = EXPANDED_SCATTERS[op]
    x = randn((1, 7), dtype, device).expand(5, 7)

    def f(x):
        return -scatter(x)
    out, reports = compile_and_run(f, (x,), dynamic=dynamic)
    expected = f(x)
    assert torch.equal(out, expected), (out, expected)
    assert out.stride() == expected.stride()
    assert kernel_count(reports) == (symbolic if dynamic else static), \
        [k["ops"] for r in reports for k in r.kernels]
    left = leftover_aten(reports)
    assert set(left) <= {"aten.diagonal.default", f"aten.{op}_scatter.default"} \
        | ({"aten.arange.start_step"} if dynamic else set()), left
