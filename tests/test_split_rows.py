"""Few long rows split across programs (row_loops.split_phases, launch.split_settings): each row's
chunks run on their own programs, one kernel per phase of the looped row kernel, the partial
reductions in between in a scratch buffer. Tests shrink the loop's step and the least chunk, so
rows of a few hundred elements split into many chunks in the interpreter; each asserts that the
launcher took the split (a spy on its ``split_settings``), the kernel count, and the values
against eager in each dtype."""
import contextlib
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler.codegen import launch
from helpers import assert_close, assert_outputs_close, kernel_count, leftover_aten
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@contextlib.contextmanager
def spied(reports):
    """The split settings each launch of the reported kernels takes while in the block."""
    paths = {k["path"] for r in reports for k in r.kernels}
    modules = [m for m in list(sys.modules.values())
               if getattr(m, "__file__", None) in paths and hasattr(m, "split_settings")]
    taken = []

    def spy(rows, n, rule=launch.split_settings):
        taken.append(rule(rows, n))
        return taken[-1]
    for m in modules:
        m.split_settings = spy
    try:
        yield taken
    finally:
        for m in modules:
            m.split_settings = launch.split_settings


def run_split(fn, args, dynamic=False):
    """(outputs of a second compiled call, reports, the split settings each launch took): the
    second call runs with a spy on the kernel modules' ``split_settings``."""
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        compiled = torch.compile(fn, backend="fusion", dynamic=dynamic, fullgraph=True)
        compiled(*args)
    with spied(reports) as taken:
        out = compiled(*args)
    return out, reports, taken


def softmax(x):
    return torch.softmax(x * 0.5, dim=-1)


def log_softmax(x):
    return torch.log_softmax(x, dim=-1)


def layer_norm(x):
    n = x.shape[-1]
    w = torch.linspace(0.5, 1.5, n, device=x.device, dtype=x.dtype)
    return F.layer_norm(x, (n,), w, None, 1e-5)


def rmsnorm_residual(x):
    h = x + 1.0
    xf = h.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return y, h


def row_stats(x):
    """Per-row outputs alone: the last stage stores them from one program a row."""
    v, m = torch.var_mean(x.float(), dim=-1)
    return v, m, x.amax(-1), x.sum(-1)


OPS = {"softmax": softmax, "log_softmax": log_softmax, "layer_norm": layer_norm,
       "rmsnorm_residual": rmsnorm_residual, "row_stats": row_stats}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_few_long_rows_split_across_programs(op, dtype, small_chunks, device):
    x = randn((3, 301), dtype, device)           # 3 rows: split into 7 chunks of 48
    fn = OPS[op]
    out, reports, taken = run_split(fn, (x,))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    split = launch.split_settings(3, 301)
    assert taken == [split] and split is not None and split[0] > 1, taken
    expected = fn(x)
    assert_outputs_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hw", [(5, 7), (4, 8)], ids=["35", "32"])
def test_group_norm_of_a_vae_block_splits_its_rows(dtype, hw, small_chunks, device):
    """Batch 1, 4 groups: four rows of 8 channels x H x W, each over several programs;
    GroupNorm, SiLU and the residual in one kernel (two stages: the mean and the variance, by
    Welford's update, then the outputs). With H x W = 32, a multiple of the step (16), a step lies in one channel and
    loads its weight and bias once (``indexing.step_divisors``); with 35, per element."""
    shape = (1, 32) + hw
    x, r = randn(shape, dtype, device), randn(shape, dtype, device)
    w, b = randn((32,), dtype, device), randn((32,), dtype, device)

    def f(x, r, w, b):
        return F.silu(F.group_norm(x, 4, w, b, eps=1e-5)) + r
    out, reports, taken = run_split(f, (x, r, w, b))
    assert kernel_count(reports) == 1 and leftover_aten(reports) == []
    assert taken and taken[0] is not None and taken[0][0] > 1, taken
    source = open(reports[0].kernels[0]["path"]).read()
    # the weight's load: once a step where the step (16) divides H x W (32), else per element
    assert f"if {hw[0] * hw[1]} % RBLOCK == 0:" in source
    # two stages: the mean with the variance, the outputs
    assert "def _split1_kernel" in source and "def _split2_kernel" not in source
    assert "fl.chan_m2(scount, " in source
    assert_close(out, f(x, r, w, b), dtype=dtype)


def test_nan_and_inf_rows_through_split_reductions(small_chunks, device):
    """A NaN in one chunk makes its whole row NaN, an Inf its max Inf, as in eager."""
    x = randn((4, 300), torch.float32, device)
    x[1, 250] = float("nan")
    x[2, 3] = float("inf")
    x[3, :] = float("-inf")
    for fn in (softmax, lambda x: x.amax(-1), lambda x: x.amin(-1), lambda x: x.sum(-1)):
        out, reports, taken = run_split(fn, (x,))
        assert kernel_count(reports) == 1 and taken[0] is not None and taken[0][0] > 1, taken
        assert_close(out, fn(x), dtype=torch.float32)


def test_rows_and_length_change_between_calls(small_chunks, device):
    """Dynamic sizes: the launcher picks a split per call (and none where the rows are many)."""
    torch._dynamo.reset()
    compiled = torch.compile(layer_norm, backend="fusion", dynamic=True, fullgraph=True)
    for rows, n in ((2, 515), (5, 250), (40, 20), (1, 33)):
        x = randn((rows, n), torch.bfloat16, device)
        assert_close(compiled(x), layer_norm(x), dtype=torch.bfloat16, name=f"{rows} x {n}")
    assert launch.split_settings(40, 20) is None          # rows shorter than two chunks


def test_split_rows_train(small_chunks, device):
    """The backward of a LayerNorm over long rows reduces per row too: both directions split."""
    x = randn((2, 300), torch.float32, device).requires_grad_()
    w = randn((300,), torch.float32, device).requires_grad_()

    def f(x, w):
        return (F.layer_norm(x, (300,), w, None) ** 2).sum()
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        compiled = torch.compile(f, backend="fusion")
        compiled(x, w).backward()
    x.grad = w.grad = None
    with spied(reports) as taken:
        out = compiled(x, w)
        out.backward()
    assert len(taken) >= 2 and all(t is not None and t[0] > 1 for t in taken), taken
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    expected = f(x, w)
    expected.backward()
    assert_close(out, expected, dtype=torch.float32, rtol=1e-4)
    assert_close(got[0], x.grad, dtype=torch.float32, atol=1e-4, rtol=1e-4, name="x grad")
    assert_close(got[1], w.grad, dtype=torch.float32, atol=1e-4, rtol=1e-4, name="w grad")


def test_split_settings_rule():
    """The rule at the real sizes (H200: 132 SMs in the interpreter too): a VAE GroupNorm's 32
    rows of 262144 take 32 chunks of 8192 (1024 programs, about 8 an SM); a batch-1 softmax
    over GPT-2's vocabulary 5; as many rows as SMs (a UNet's GroupNorm at batch 8: 256 rows),
    or rows shorter than two chunks, none."""
    launch.split_settings.cache_clear()
    assert launch.split_settings(32, 262144)[:3] == (32, 8192, 32)
    assert launch.split_settings(1, 50257)[:3] == (5, 10240, 8)
    assert launch.split_settings(131, 50257)[0] == 5
    assert launch.split_settings(132, 50257) is None
    assert launch.split_settings(256, 20480) is None
    assert launch.split_settings(4096, 50257) is None
    assert launch.split_settings(1, 16383) is None
    s, chunk, sblock, rblock, _ = launch.split_settings(7, 10**6)
    assert s * chunk >= 10**6 > (s - 1) * chunk and chunk % rblock == 0
    assert sblock >= s > 1


def test_step_divisors():
    """What a loop step reads once: a value of the columns only through ``cols // K``."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    from fusion_compiler.codegen.indexing import step_divisors
    c, r = sympy.symbols("cols rindex", integer=True, nonnegative=True)
    assert step_divisors(4 * r + FloorDiv(c, 4096), c) == {4096}
    assert step_divisors(ModularIndexing(c, 64, 8) + 3 * FloorDiv(c, 4096), c) == {64, 4096}
    assert step_divisors(c + 16 * r, c) is None                 # per element
    assert step_divisors(FloorDiv(c + 5, 64), c) is None        # a shifted channel boundary
    assert step_divisors(c % 64, c) is None
    assert step_divisors(4 * r, c) is None                      # per row: not a loop's load


def test_each_stage_is_keyed_by_its_own_sizes(small_chunks, device):
    """The stages share a launch key only where they take the same arguments: a stage reading
    a size the one before does not read (under dynamic shapes, the weights' H x W in the last
    stage) keys on that size's specialization too (its % 16 and == 1), or a relaunch could
    reuse a kernel compiled for another."""
    x = randn((1, 8, 5, 6), torch.float32, device)
    w, b = randn((8,), torch.float32, device), randn((8,), torch.float32, device)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:
        torch.compile(lambda x, w, b: F.group_norm(x, 2, w, b), backend="fusion",
                      dynamic=True)(x, w, b)
    source = open(reports[0].kernels[0]["path"]).read()
    launcher = source[source.index("def launch("):]
    key = None
    checked = 0
    for line in launcher.splitlines():
        line = line.strip()
        if line.startswith("key = ("):
            key = line
        m = re.match(r"first_launch\(_COMPILED_split\d+, key, _split\d+_kernel, R \* S, (.*)\)$",
                     line)
        if m:
            sizes = [a for a in m.group(1).split(", ") if re.fullmatch(r"k\d+", a)]
            assert all(f"{a} & 15" in key for a in sizes), (line, key)
            checked += 1
    assert checked == source.count("def _split") >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_over_split_rows(dtype, small_chunks, device):
    """A cross-entropy's per-row loss is a block of one (the ignored target's constant meets
    it) stored at the row's scalar address by the last stage: it crashed there before."""
    x = randn((3, 301), dtype, device)
    t = torch.tensor([5, -100, 300], device=device)

    def f(x, t):
        return F.cross_entropy(x.float(), t)
    out, reports, taken = run_split(f, (x, t))
    assert taken and taken[0] is not None and taken[0][0] > 1, taken
    # the mean over the rows that count: the losses' sum in a kernel, the count of the rows
    # (a sum of integers) left to ATen
    assert leftover_aten(reports) == ["aten.sum.dim_IntList"]
    assert_close(out, f(x, t), dtype=torch.float32)
