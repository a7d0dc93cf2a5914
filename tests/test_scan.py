"""Cumulative sums (``cumsum`` over the last dim, or over another as over the last of a permuted
view) as scans in persistent row kernels, fused with what computes their input and what reads
their result; ``flip`` as index arithmetic, so that a cumsum's gradient (the flipped cumsum of
the flipped gradient) is one kernel. Kernel counts and
values against eager on random data, odd sizes, each dtype with its tolerance; what stays on
ATen says why."""
import pytest
import torch

import fusion_compiler
from helpers import (TOL, aten_reasons, assert_close, compile_and_run, kernel_count, leftover_aten,
                     segment_sum)
from patterns import randn

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _scan_tol(dtype, n):
    """A prefix sum of n terms in another order than eager's (a tree in the kernel, a running
    sum in eager), both in fp32, rounded to ``dtype`` once: a few fp32 ulps of the prefix's
    sum of |x|, then one rounding of the result that may fall the other way."""
    atol, rtol = TOL[dtype]
    return atol * max(1, n ** 0.5), rtol


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(5, 37), (3, 4, 129), (1000,)], ids=str)
def test_a_cumsum_between_pointwise_ops_is_one_kernel(shape, dtype, device):
    """Producer, scan and consumer in one persistent row kernel, no ATen op."""
    x = randn(shape, dtype, device)
    f = lambda a: (torch.cumsum(a * 0.5 + 1, -1) * 0.25).sigmoid()      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for k in reports[0].kernels] == ["cumsum"]
    atol, rtol = _scan_tol(dtype, shape[-1])
    assert_close(out, f(x), dtype=dtype, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_a_softmax_of_a_cumsum_is_one_kernel(dtype, device):
    """A reduction reading the scan's values: the max and the sum of exps over the prefix
    sums, in the same registers."""
    x = randn((6, 50), dtype, device)
    f = lambda a: torch.softmax(torch.cumsum(a, -1), -1)       # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x), dtype=dtype, atol=4 * TOL[dtype][0], rtol=4 * TOL[dtype][1])


def test_a_cumsum_after_a_reduction_scans_what_the_row_computes(device):
    """cumsum(exp(x - max)) / sum: the scan reads values of the second phase."""
    x = randn((7, 33), torch.float32, device)

    def f(a):
        e = torch.exp(a - a.amax(-1, keepdim=True))
        return torch.cumsum(e, -1) / e.sum(-1, keepdim=True)
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    want = f(x)
    assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out[:, -1], torch.ones(7, device=device), atol=1e-5)


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_position_ids_from_a_padding_mask_are_exact(mask_dtype, device):
    """BLOOM's alibi and OPT's positions: ``(mask.cumsum(-1) - 1) * mask`` on an integer
    mask, exact in int64 (ATen's result dtype for integer and bool inputs)."""
    mask = (torch.rand(8, 61, device=device) > 0.3).to(mask_dtype)
    f = lambda m: (m.cumsum(-1) - 1) * m      # noqa: E731
    out, reports = compile_and_run(f, (mask,))
    want = f(mask)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert out.dtype == want.dtype == torch.int64 and torch.equal(out, want)


def test_large_integer_prefix_sums_do_not_overflow_int32(device):
    """int32 inputs summed in int64, as ATen: prefix sums past 2^31."""
    x = torch.full((2, 300), 2 ** 24, dtype=torch.int32, device=device)
    x[1] = -x[1]
    f = lambda a: torch.cumsum(a, -1) + 1       # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and torch.equal(out, f(x))
    assert out[0, -1] == 300 * 2 ** 24 + 1 > 2 ** 31


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_cumsum_into_fp32_of_a_low_precision_input(dtype, device):
    """``dtype=torch.float32``: accumulated and stored in fp32."""
    x = randn((4, 77), dtype, device)
    f = lambda a: torch.cumsum(a * 2, -1, dtype=torch.float32)     # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    want = f(x)
    assert out.dtype == torch.float32
    assert_close(out, want, atol=1e-5 * 77, rtol=1e-5)


def test_low_precision_prefixes_round_each_element_once(device):
    """Each prefix is summed in fp32 and rounded once (as ATen's CPU scan and Inductor's): 256
    + 1 + ... in bf16 keeps counting where a bf16 running sum sticks. ATen's CUDA scan adds
    bf16 partial sums in bf16 (on the H200 it gives 256, 256, 256, 258 for 256, 257, 258, 259
    rounded: 256, 256, 258, 260), so the reference is the fp32 scan rounded."""
    x = torch.ones(2, 40, dtype=torch.bfloat16, device=device)
    x[:, 0] = 256
    f = lambda a: torch.cumsum(a * 1, -1)       # noqa: E731
    out, reports = compile_and_run(f, (x,))
    want = torch.cumsum(x.float(), -1).to(torch.bfloat16)
    assert kernel_count(reports) == 1 and torch.equal(out, want)
    assert out[0, -1] == 296


def test_nan_and_inf_propagate_along_the_row(device):
    x = randn((3, 20), torch.float32, device)
    x[0, 5], x[1, 7], x[2, 3] = float("nan"), float("inf"), -float("inf")
    f = lambda a: torch.cumsum(a + 1, -1)      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1
    want = f(x)
    assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.isnan(out[0, 5:]).all() and not torch.isnan(out[0, :5]).any()
    assert torch.isposinf(out[1, 7:]).all()


def test_strided_rows_scan_along_the_row(device):
    """A transposed input: the row's elements lie apart in memory."""
    x = randn((45, 6), torch.float32, device).t()
    f = lambda a: torch.cumsum(a * 3, -1) - a      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x), atol=1e-5 * 45, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_cumsum_gradient_is_one_kernel(dtype, device):
    """The backward of cumsum is ``flip(cumsum(flip(g)))``: the gradient read flipped, the
    scan, the result stored flipped; before, the flips and the scan ran on ATen."""
    x = randn((6, 45), dtype, device).requires_grad_()
    f = lambda a: torch.cumsum(a, -1).sin()     # noqa: E731
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(f, backend="fusion", fullgraph=True)(x)
        out.sum().backward()
    got = x.grad
    x.grad = None
    want = f(x)
    want.sum().backward()
    atol, rtol = _scan_tol(dtype, 45)
    assert_close(out, want, dtype=dtype, atol=atol, rtol=rtol)
    assert_close(got, x.grad, dtype=dtype, atol=4 * atol, rtol=4 * rtol, name="grad")
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "forward") == 1 and kernel_count(reports, "backward") == 1
    # the flips cancel: a reverse scan of the gradient read forwards, not reads backwards
    src = open(next(r for r in reports if r.kind == "backward").kernels[0]["path"]).read()
    assert "reverse=True)" in src and "44 - cols" not in src


@pytest.mark.parametrize("dims", [(-1,), (0,), (0, 1), (1, 2)], ids=str)
def test_flip_is_index_arithmetic(dims, device):
    x = randn((3, 5, 7), torch.float32, device)
    f = lambda a: a.flip(dims) * 2 + 1         # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert torch.equal(out, f(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_flipped_cumsum_is_a_reverse_scan(dtype, device):
    """Sums from each element to the row's end, written as flips (as autograd writes a
    cumsum's gradient) and with a producer and reader around: one kernel, a reverse scan."""
    x = randn((4, 3, 29), dtype, device)
    f = lambda a: (torch.cumsum((a * 2).flip(-1), -1).flip(-1) + 1).relu()    # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert "reverse=True)" in open(reports[0].kernels[0]["path"]).read()
    atol, rtol = _scan_tol(dtype, 29)
    assert_close(out, f(x), dtype=dtype, atol=atol, rtol=rtol)


def test_a_cumsum_flipped_along_another_dim_is_stored_flipped(device):
    """A cumsum flipped over the rows as the output: the scan forwards, stored at the flipped
    index (row_outputs.layout_chain). (An op reading the flip would read the scan at another
    row: its own kernel.)"""
    x = randn((5, 23), torch.float32, device)
    f = lambda a: torch.cumsum(a * 3, -1).flip(0)      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, f(x), atol=1e-5 * 23, rtol=1e-5)


def test_a_scan_read_at_another_position_is_its_own_kernel(device):
    """A transpose of the scan's result read by an op: the scan is stored by its kernel and
    the op reads it from memory (never computed at another position)."""
    x, y = randn((9, 9), torch.float32, device), randn((9, 9), torch.float32, device)
    f = lambda a, b: torch.cumsum(a, -1).t() * b      # noqa: E731
    out, reports = compile_and_run(f, (x, y))
    assert leftover_aten(reports) == [] and kernel_count(reports) == 2
    assert_close(out, f(x, y), atol=1e-5 * 9, rtol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape,dim", [((37, 19), 0), ((3, 23, 17), 1), ((4, 5, 6, 16), 1),
                                       ((29, 4, 5), 0), ((3, 11, 2, 3, 9), -3), ((17, 17), 0),
                                       ((2, 16, 3, 16), 1)], ids=str)
def test_a_cumsum_over_another_dim_scans_strided_rows(shape, dim, dtype, device):
    """A cumsum over a dim other than the last: a row kernel over the permuted view's rows,
    with its producer and reader, the result in ATen's contiguous layout (passes/scan_dims.py).
    Before, ATen's scan, and the producer's output written out for it."""
    x = randn(shape, dtype, device)
    f = lambda a: (torch.cumsum(a * 0.5 + 1, dim) * 0.25).sigmoid()      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    want = f(x)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for k in reports[0].kernels] == ["cumsum"]
    atol, rtol = _scan_tol(dtype, shape[dim])
    assert_close(out, want, dtype=dtype, atol=atol, rtol=rtol)
    assert out.stride() == want.stride()


def test_a_cumsum_over_the_first_dim_of_a_transposed_input_reads_rows_in_place(device):
    """The scanned dim at stride 1 (a transposed input): its rows are contiguous in memory;
    the result is contiguous, as ATen's."""
    x = randn((45, 7), torch.float32, device).t()
    f = lambda a: torch.cumsum(a * 3, 0) - 1      # noqa: E731
    out, reports = compile_and_run(f, (x,))
    want = f(x)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_close(out, want, atol=1e-5 * 7, rtol=1e-5)
    assert out.stride() == want.stride() == (45, 1)


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.bool], ids=str)
def test_integer_prefix_sums_over_the_first_dim_are_exact(mask_dtype, device):
    mask = (torch.rand(33, 18, device=device) > 0.3).to(mask_dtype)
    f = lambda m: m.cumsum(0) * 3 - 1       # noqa: E731
    out, reports = compile_and_run(f, (mask,))
    want = f(mask)
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert out.dtype == want.dtype == torch.int64 and torch.equal(out, want)


@pytest.mark.parametrize("shape", [(5, 23, 17), (3, 19, 19)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gradient_of_a_cumsum_over_another_dim_is_one_kernel(shape, dtype, device):
    """The backward's flipped cumsum over dim 1 of the flipped gradient: a reverse scan over
    the permuted rows, one kernel each way. Against eager in fp32, rounded: eager's CUDA scan
    adds bf16 in bf16 (on an H100, one gradient of 23 terms off by 0.33 where the kernel's
    fp32 sum was within an ulp)."""
    x = randn(shape, dtype, device).requires_grad_()
    f = lambda a: torch.cumsum(a, 1).sin()     # noqa: E731
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(f, backend="fusion", fullgraph=True)(x)
        out.sum().backward()
    x32 = x.detach().float().requires_grad_()
    want = f(x32)
    want.sum().backward()
    atol, rtol = _scan_tol(dtype, shape[1])
    assert_close(out, want.to(dtype), dtype=dtype, atol=atol, rtol=rtol)
    assert_close(x.grad, x32.grad.to(dtype), dtype=dtype, atol=4 * atol, rtol=4 * rtol,
                 name="grad")
    assert leftover_aten(reports) == []
    assert kernel_count(reports, "forward") == 1 and kernel_count(reports, "backward") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba2_segment_sums_are_one_kernel(dtype, device):
    """transformers' Mamba2 ``segment_sum`` (its PyTorch path, which torch.compile traces):
    the chunk's decays expanded to [l, l], masked, summed down the columns (``cumsum(dim=-2)``),
    masked with -inf, exp: one kernel over the columns as rows, storing the [l, l] block in its
    own layout (a square transposition: the rows take a leading dim of 1). Before, the masked
    expand written out, ATen's cumsum, and a kernel for the mask and exp (H100, [4, 32, 4, 256]
    decays: 287 us, Inductor's one kernel 51 us; `benchmarks/scan.py --cases segsum`)."""
    x = -randn((2, 3, 2, 20), dtype, device).abs()

    def f(a):
        return torch.exp(segment_sum(a))
    out, reports = compile_and_run(f, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert [k["label"] for k in reports[0].kernels] == ["cumsum"]
    atol, rtol = _scan_tol(dtype, 20)
    # against eager in fp32, rounded (eager's CUDA scan adds bf16 in bf16)
    assert_close(out, f(x.float()).to(dtype), dtype=dtype, atol=atol, rtol=rtol)


def decayed_states(A, Gb, b, c, h):
    """transformers 5.17's Mamba2 in small: a bmm's result Gb [b*c*h, l, s] laid out as G
    [b, c, l, s, h] by a clone (an output: the backward reads it), times the segment sums'
    decays exp(segment_sum(A)) in that layout, a sum over a dim of 1, stored [b, c, h, l, s]."""
    l = Gb.shape[-1]
    G = Gb.view(b, c, h, l, l).permute(0, 1, 3, 4, 2).contiguous()
    L = torch.exp(segment_sum(A))
    M = (G[..., None] * L.permute(0, 2, 3, 4, 1)[..., None]).sum(-1)
    return G, M.permute(0, 1, 4, 2, 3).contiguous()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("sizes", [(2, 2, 8, 16), (1, 3, 4, 24), (2, 1, 4, 17)], ids=str)
def test_a_layout_copy_the_scan_kernel_reads_is_written_there(sizes, dtype, device):
    """The clone of the bmm's result, read by the row kernel at one element per element of the
    product it multiplies (row_outputs.read_beside), is written by that kernel: one kernel that
    reads the bmm's result, where a kernel of its own wrote the clone and the row kernel read
    it back. h (the clone's contiguous dim) of 8 and 4: a tile of rows takes it whole, or a
    sector of it in fp32. Odd sizes: rows of 24 and 17 (masked columns), a chunk of 1."""
    b, c, h, l = sizes
    A = -randn((b, h, c, l), dtype, device).abs() * 0.1
    Gb = randn((b * c * h, l, l), dtype, device)
    fn = lambda a, g: decayed_states(a, g, b, c, h)     # noqa: E731
    out, reports = compile_and_run(fn, (A, Gb))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    G, M = fn(A, Gb)
    assert torch.equal(out[0], G) and out[0].stride() == G.stride()     # a copy: exact
    atol, rtol = _scan_tol(dtype, l)
    want = fn(A.float(), Gb.float())[1].to(dtype)   # eager's CUDA scan adds bf16 in bf16
    assert out[1].stride() == M.stride()
    assert_close(out[1], want, dtype=dtype, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("h,tiles,why", [(5, "1", "runs under a sector"),
                                         (2, "1", "runs under a sector"),
                                         (12, "1", "runs under a sector"),
                                         (8, "0", "needs a tile of rows")], ids=str)
def test_a_layout_copy_no_tile_writes_in_sectors_keeps_its_own_kernel(h, tiles, why, dtype,
                                                                       device, monkeypatch):
    """h of 5, 2 or 12: no tile of rows takes a sector of h (a power of two of 32 bytes) or
    all of it, so the kernel would write the clone in part sectors (Mamba2's G in runs of 16
    bytes: 576 us fused against 94 + 225 unfused, H100); h of 8 with
    ``FUSION_COMPILER_TILES=0``: no tile at all, one element a sector (with tiles the row
    kernel writes it). The clone keeps a kernel of its own, refused for that reason, and the
    values are eager's."""
    monkeypatch.setenv("FUSION_COMPILER_TILES", tiles)
    b, c, l = 2, 2, 16
    A = -randn((b, h, c, l), dtype, device).abs() * 0.1
    Gb = randn((b * c * h, l, l), dtype, device)
    fn = lambda a, g: decayed_states(a, g, b, c, h)     # noqa: E731
    out, reports = compile_and_run(fn, (A, Gb))
    assert kernel_count(reports) == 2 and leftover_aten(reports) == []
    reasons = [d["reason"] for r in reports for d in r.decisions if not d["taken"]]
    assert any(why in reason for reason in reasons), reasons
    G, M = fn(A, Gb)
    assert torch.equal(out[0], G) and out[0].stride() == G.stride()
    atol, rtol = _scan_tol(dtype, l)
    assert_close(out[1], fn(A.float(), Gb.float())[1].to(dtype), dtype=dtype, atol=atol,
                 rtol=rtol)


def softmax_states(A, Gb, b, c, h):
    """``decayed_states`` with a softmax's row kernel in place of the scan's: rows of l that
    may loop (no scan holds them in one block)."""
    l = Gb.shape[-1]
    G = Gb.view(b, c, h, l, l).permute(0, 1, 3, 4, 2).contiguous()
    M = (G[..., None] * torch.softmax(A, -1).permute(0, 2, 3, 4, 1)[..., None]).sum(-1)
    return G, M.permute(0, 1, 4, 2, 3).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("l,block,kernels", [(16, "16384", 1), (16, "8", 2), (17, "8", 2)],
                         ids=str)
def test_a_layout_copy_beside_a_looped_row_keeps_its_own_kernel(l, block, kernels, dtype,
                                                                 device, monkeypatch):
    """Rows longer than ``max_persistent_block`` loop, and a looped kernel has no tile of rows:
    legality lowers what the generator will make (codegen/render.lower_rows), so the clone is
    refused there and keeps its own kernel beside the fused softmax. Before, legality lowered
    every row as persistent, passed the group, and the generator's refusal left all ten ops
    on ATen."""
    monkeypatch.setenv("FUSION_COMPILER_MAX_PERSISTENT_BLOCK", block)
    b, c, h = 1, 2, 8
    A = randn((b, h, c, l, l), dtype, device)
    Gb = randn((b * c * h, l, l), dtype, device)
    fn = lambda a, g: softmax_states(a, g, b, c, h)     # noqa: E731
    out, reports = compile_and_run(fn, (A, Gb))
    assert kernel_count(reports) == kernels and leftover_aten(reports) == []
    reasons = [d["reason"] for r in reports for d in r.decisions if not d["taken"]]
    assert (kernels == 2) == any("needs a tile of rows" in why for why in reasons), reasons
    G, M = fn(A, Gb)
    assert torch.equal(out[0], G) and out[0].stride() == G.stride()
    want = fn(A.float(), Gb.float())[1].to(dtype)
    assert out[1].stride() == M.stride()
    assert_close(out[1], want, dtype=dtype)


def test_training_through_the_layout_copy_written_by_the_scan_kernel(device):
    """Gradients of A and the bmm's result through the forward that writes the clone beside
    the decayed product (the clone is what autograd keeps for the backward)."""
    b, c, h, l = 2, 2, 4, 16
    A = (-randn((b, h, c, l), torch.float32, device).abs() * 0.1).requires_grad_()
    Gb = randn((b * c * h, l, l), torch.float32, device).requires_grad_()
    fn = lambda a, g: decayed_states(a, g, b, c, h)     # noqa: E731
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        got = torch.compile(fn, backend="fusion", fullgraph=True)(A, Gb)
        weights = [torch.randn_like(o) for o in got]
        grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), (A, Gb))
    want = fn(A, Gb)
    wgrads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, weights)), (A, Gb))
    assert kernel_count(reports, "forward") == 1
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32, atol=1e-5 * l, rtol=1e-5)
    for name, g, w in zip(["A", "Gb"], grads, wgrads):
        assert_close(g, w, torch.float32, atol=1e-4 * l, rtol=1e-4, name=f"grad of {name}")


def test_what_stays_on_aten_says_why(device):
    """Other dims whose rows lie side by side in short runs (ATen's scan), fp64, and rows
    longer than one block."""
    x = randn((20, 6), torch.float32, device)
    g = lambda a: torch.cumsum(a * 2, 0)        # noqa: E731
    out, reports = compile_and_run(g, (x,))
    assert_close(out, g(x), atol=1e-5, rtol=1e-5)
    assert leftover_aten(reports) == ["aten.cumsum.default"]
    assert "cumsum over dim 0: its rows lie side by side in runs under 16 elements" \
        in aten_reasons(g, x)
    d = lambda a: torch.cumsum(a.double() * 2, -1)     # noqa: E731
    out, reports = compile_and_run(d, (x,))
    assert torch.allclose(out, d(x)) and "aten.cumsum.default" in leftover_aten(reports)
    long = randn((2, 16385), torch.float32, device)
    h = lambda a: torch.cumsum(a * 2, -1) + 1   # noqa: E731
    out, reports = compile_and_run(h, (long,))
    assert_close(out, h(long), atol=1e-3, rtol=1e-4)
    assert "aten.cumsum.default" in leftover_aten(reports)
    assert any("at most 16384 elements" in why for r in reports
               for _, why in r.groups_not_generated) or any(
        "at most 16384 elements" in r for r in aten_reasons(h, long))


def test_dynamic_row_length_stays_on_aten(device):
    x = randn((4, 30), torch.float32, device)
    torch._dynamo.mark_dynamic(x, 1)
    f = lambda a: torch.cumsum(a * 2, -1) + 1  # noqa: E731
    out, reports = compile_and_run(f, (x,), dynamic=True)
    assert_close(out, f(x), atol=1e-5 * 30, rtol=1e-5)
    assert "aten.cumsum.default" in leftover_aten(reports)


def test_the_scan_is_tl_cumsum_over_the_masked_row(device):
    x = randn((5, 37), torch.float32, device)
    _, reports = compile_and_run(lambda a: torch.cumsum(a * 2, -1), (x,))
    src = "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)
    assert "tl.cumsum(tl.where(mask, " in src and "axis=1)" in src
