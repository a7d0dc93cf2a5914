"""Rows longer than a persistent program's block held in registers by the resident kernel
(resident.resident_phases): one program a row holds it as static chunks, every column statement
written once a chunk, each reduction combining its chunks before reducing once; the row is read
once, where the looped kernel reads it once a pass. Tests hold rows of up to 208 elements in
chunks of 16 (``small_resident``: 13 chunks, as the default's 53248 in chunks of 4096), assert
the kernel count, that the resident kernel ran (not the looped or split ones), and the values
against eager in each dtype, on aligned rows (every chunk inside the row), unaligned rows
(chunks from the row's 16 bytes, at every shift), rows at the limit and past it, NaN and
+-inf, training, and few rows (split) beside many (resident)."""
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from helpers import assert_close, assert_outputs_close, kernel_count, leftover_aten
from patterns import randn
from test_welford import layer_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def softmax(x):
    return torch.softmax(x * 0.5, dim=-1)


def log_softmax_fp32(x):
    return torch.log_softmax(x.float(), dim=-1)


def rms_norm(x):
    xf = x.float()
    w = torch.linspace(0.5, 1.5, x.shape[-1], device=x.device, dtype=x.dtype)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def row_stats(x):
    """Per-row outputs beside a row output."""
    v, m = torch.var_mean(x.float(), dim=-1)
    return x.amax(-1), v, m, torch.exp(x - x.amax(-1, keepdim=True))


OPS = {"softmax": softmax, "log_softmax_fp32": log_softmax_fp32, "layer_norm": layer_norm,
       "rms_norm": rms_norm, "row_stats": row_stats}


def source(reports):
    return "\n".join(open(k["path"]).read() for r in reports for k in r.kernels)


class _Spy:
    """A generated module's row kernel, counting its launches."""

    def __init__(self, kernel, kind, counts):
        self.kernel, self.kind, self.counts = kernel, kind, counts

    def __getitem__(self, grid):
        self.counts[self.kind] += 1
        return self.kernel[grid]

    def warmup(self, *args, **kwargs):      # the GPU's first launch (launch.first_launch)
        self.counts[self.kind] += 1
        return self.kernel.warmup(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


KINDS = ("resident", "looped", "split0")


def run(fn, args, dynamic=False):
    """(outputs of a second compiled call, reports, the row kernels that call launched by
    kind): the second call runs with spies on the kernel modules' row kernels, their direct
    relaunches dropped so that every launch goes through them."""
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        compiled = torch.compile(fn, backend="fusion", dynamic=dynamic, fullgraph=True)
        compiled(*args)
    paths = {k["path"] for r in reports for k in r.kernels}
    modules = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) in paths]
    counts = dict.fromkeys(KINDS, 0)
    saved = []
    for m in modules:
        for kind in KINDS:
            if hasattr(m, f"_{kind}_kernel"):
                saved.append((m, kind, getattr(m, f"_{kind}_kernel")))
                setattr(m, f"_{kind}_kernel", _Spy(saved[-1][2], kind, counts))
                getattr(m, f"_COMPILED_{kind}").clear()
    try:
        out = compiled(*args)
    finally:
        for m, kind, kernel in saved:
            setattr(m, f"_{kind}_kernel", kernel)
    return out, reports, counts


def assert_ran(counts, kind="resident"):
    assert counts[kind] >= 1 and all(counts[k] == 0 for k in KINDS if k != kind), counts


# 17: two chunks; 48: aligned in every dtype (no mask inside the row); 201: unaligned
# (bf16/fp16 rows of 201 with 7 columns before them: the 13 chunks of the limit)
@pytest.mark.parametrize("n", [17, 48, 201])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_rows_held_in_registers(op, dtype, n, small_resident, device):
    x = randn((9, n), dtype, device)
    fn = OPS[op]
    out, reports, ran = run(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_ran(ran)
    src = source(reports)
    assert "def _looped_kernel" not in src
    # a weight read by column takes no shift (kernel_source._row_shift)
    shifted = n * dtype.itemsize % 16 != 0 and op not in ("layer_norm", "rms_norm")
    assert ("rowa = (rstart // " in src) == shifted
    assert_outputs_close(out, fn(x))


def add_layer_norm(x, r):
    h = x + r
    return layer_norm(h), h


@pytest.mark.parametrize("dtype, n, held", [
    (torch.float32, 201, False), (torch.float32, 100, True), (torch.bfloat16, 201, True)])
def test_rows_held_where_their_values_fit(dtype, n, held, small_resident, device):
    """The registers' estimate (resident._held_values, at most launch.RESIDENT_VALUES = 20
    chunks x fp32 values an element): an add+LayerNorm loads two rows before its first
    reduction, 2 values an element in fp32 (13 chunks at 201: 26, looped; 7 at 100: 14), 1 in
    bf16 (13); its weight and bias, loaded after, a chunk at a time, are not counted."""
    x, r = randn((9, n), dtype, device), randn((9, n), dtype, device)
    out, reports, ran = run(add_layer_norm, (x, r))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_ran(ran, "resident" if held else "looped")
    assert_outputs_close(out, add_layer_norm(x, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_past_the_limit_loops(dtype, small_resident, device):
    """202 bf16 elements and the 7 columns before them make 209 > 208: the looped kernel; fp32
    rows of 201 are held (the rule counts 7 columns for every dtype)."""
    n = 202 if dtype == torch.bfloat16 else 201
    x = randn((5, n), dtype, device)
    out, reports, ran = run(softmax, (x,))
    assert kernel_count(reports) == 1
    assert_ran(ran, "looped" if dtype == torch.bfloat16 else "resident")
    assert_outputs_close(out, softmax(x))


def test_dynamic_row_length_loops(small_resident, device):
    """The chunks are static: a row length known only at run time takes the looped kernel."""
    x = randn((6, 50), torch.float32, device)
    out, reports, ran = run(softmax, (x,), dynamic=True)
    assert "def _resident_kernel" not in source(reports)
    assert_ran(ran, "looped")
    assert_outputs_close(out, softmax(x))


def test_nan_and_inf_rows(small_resident, device):
    """A NaN makes its row NaN, an infinity its max and mean that infinity (as ``x.mean``;
    eager's var_mean gives NaN there on the CPU, its Welford update), wherever it lies."""
    x = randn((6, 96), torch.float32, device)
    x[1, 7] = float("nan")          # in the first chunk
    x[2, 95] = float("inf")         # in the last
    x[3, 50] = float("-inf")
    x[4, :] = float("-inf")         # every element: eager's softmax is NaN
    x[5, 30] = float("inf")
    x[5, 80] = float("-inf")
    for fn in (softmax, layer_norm, row_stats):
        out, reports, ran = run(fn, (x,))
        assert_ran(ran)
        expected = fn(x)
        if fn is row_stats:
            expected = expected[:2] + (x.mean(-1),) + expected[3:]
        assert_outputs_close(out, expected)


def test_layer_norm_training(small_resident, device):
    """The backward's per-row sums over the same rows are held too; gradients match."""
    x = randn((7, 80), torch.float32, device).requires_grad_()
    w = torch.linspace(0.5, 1.5, 80, device=device).requires_grad_()
    b = torch.linspace(-1, 1, 80, device=device).requires_grad_()
    g = torch.randn(7, 80, device=device)

    def f(x, w, b, g):
        out = F.layer_norm(x, (80,), w, b, 1e-5)
        return (out,) + torch.autograd.grad(out, (x, w, b), g)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    expected = f(x2, w2, b2, g)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(lambda x, w, b: F.layer_norm(x, (80,), w, b, 1e-5),
                            backend="fusion")(x, w, b)
        grads = torch.autograd.grad(out, (x, w, b), g)
    for kind in ("forward", "backward"):
        assert kernel_count(reports, kind) >= 1
        assert "def _resident_kernel" in source([r for r in reports if r.kind == kind]), kind
    assert_close(out, expected[0], name="output")
    for a, e, name in zip(grads, expected[1:], ("x", "w", "b")):
        assert_close(a, e, atol=1e-4, rtol=1e-4, name=f"grad of {name}")


@pytest.mark.parametrize("rows, kind", [(3, "split0"), (8, "resident")])
def test_few_rows_split_many_held(rows, kind, small_resident, device):
    """Fewer rows than SMs split across programs (the split stages); as many as SMs or more
    are held, a program a row. Run as on a GPU of 8 SMs (132 rows, the H200's count, took
    41-55 s in the interpreter)."""
    from fusion_compiler.codegen import launch
    small_resident.setattr(launch, "_sm_count", lambda: 8)
    small_resident.setattr(launch, "SPLIT_RBLOCK", 16)
    small_resident.setattr(launch, "SPLIT_MIN_CHUNK", 32)
    launch.split_settings.cache_clear()
    x = randn((rows, 100), torch.bfloat16, device)
    out, reports, ran = run(softmax, (x,))
    assert kernel_count(reports) == 1
    assert_ran(ran, kind)
    assert_outputs_close(out, softmax(x))


def test_rows_change_between_calls(small_resident, device):
    """Rows known only at run time (the row length static): one resident kernel serves every
    row count, a program a row."""
    torch._dynamo.reset()
    compiled = torch.compile(softmax, backend="fusion", fullgraph=True)
    for rows in (5, 11, 3):
        x = randn((rows, 100), torch.bfloat16, device)
        torch._dynamo.mark_dynamic(x, 0)
        with fusion_compiler.capture_compiles() as reports:
            out = compiled(x)
        if rows == 5:
            text = source(reports)
            assert "def _resident_kernel" in text and "def _looped_kernel" not in text
            assert re.findall(r"^    [RN] = .*$", text, re.M) == ["    R = k0", "    N = 100"]
        assert_close(out, softmax(x), name=f"{rows} rows")


def test_statement_order(small_resident, device):
    """The first phase statement by statement (every chunk's row load before the first
    reduction), the later ones chunk by chunk with their weight loads a chunk ahead; the
    residual's store where its value is made (before the reductions)."""
    x, r = randn((9, 96), torch.bfloat16, device), randn((9, 96), torch.bfloat16, device)
    out, reports, ran = run(add_layer_norm, (x, r))
    assert_ran(ran)
    text = source(reports)
    body = text[text.index("def _resident_kernel"):text.index("def _split0_kernel")]
    lines = [ln.strip() for ln in body.splitlines()]

    def first(pattern):
        return next(i for i, ln in enumerate(lines) if re.search(pattern, ln))
    reduce = first(r"= tl\.sum\(")
    assert first(r"_5 = tl\.load\(\(in0 ") < reduce and first(r"_5 = tl\.load\(\(in1 ") < reduce
    assert first(r"tl\.store\(\(out0 .* cols_5,") < reduce       # h = x + r
    weight_1 = first(r"_1 = tl\.load\(\(in2 \+ 0\) \+ cols_1,")
    assert first(r"_0 = tl\.load\(\(in2 \+ 0\) \+ cols_0,") < weight_1 \
        < first(r"tl\.store\(\(out1 .* cols_0,") < first(r"_2 = tl\.load\(\(in2 \+ 0\) \+ cols_2,")
    assert_outputs_close(out, add_layer_norm(x, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_with_ignored_targets(dtype, small_resident, device):
    """The target's logit gathered by index beside the held row, a per-row loss stored from a
    block of one (an ignored target meets a constant), the mean over the counted rows."""
    x = randn((7, 150), dtype, device)
    t = torch.randint(0, 150, (7,), device=device)
    t[2] = -100

    def f(x, t):
        return F.cross_entropy(x.float(), t)
    out, reports, ran = run(f, (x, t))
    assert_ran(ran)
    assert_close(out, f(x, t), name="loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_softmax_training(dtype, small_resident, device):
    """The backward's row (the gradient and the softmax's output, two row inputs) is held
    too; gradients match."""
    x = randn((6, 130), dtype, device).requires_grad_()
    g = randn((6, 130), dtype, device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        out = torch.compile(softmax, backend="fusion")(x)
        (grad,) = torch.autograd.grad(out, (x,), g)
    x2 = x.detach().clone().requires_grad_()
    ref = softmax(x2)
    (expected,) = torch.autograd.grad(ref, (x2,), g)
    for kind in ("forward", "backward"):
        assert "def _resident_kernel" in source([r for r in reports if r.kind == kind]), kind
    assert_close(out, ref, name="output")
    assert_close(grad, expected, name="grad")


def test_padded_and_concatenated_rows(small_resident, device):
    """Rows made in the kernel by a pad and a cat along them: the columns' predicates pick
    each chunk's source, as the persistent kernel's do."""
    a, b = randn((5, 70), torch.float32, device), randn((5, 61), torch.float32, device)

    def f(a, b):
        row = torch.cat([F.pad(a, (3, 2), value=-1.0), b * 2], dim=-1)     # 75 + 61 = 136
        return torch.softmax(row, -1)
    out, reports, ran = run(f, (a, b))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert_ran(ran)
    assert_close(out, f(a, b))
