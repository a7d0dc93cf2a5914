"""On the GPU: the patterns at realistic sizes, FP8 outputs checked bit for bit.

The interpreter (CPU) runs the same kernels on small shapes; these use real Triton compilation,
the hardware fp8 conversion, and sizes where rows are split across many programs.
"""
import pytest
import torch

from helpers import as_tuple, assert_close, assert_fp8_matches, compile_and_run, kernel_count
from patterns import PATTERNS, make_args

pytestmark = pytest.mark.gpu

LARGE = [(2048, 4096), (333, 11008), (64, 65536)]


@pytest.mark.parametrize("rows,n", LARGE)
@pytest.mark.parametrize("name", ["add_rmsnorm", "add_layernorm", "swiglu", "bias_gelu",
                                  "rmsnorm_fp8", "rmsnorm_dynamic_fp8", "dequant_add",
                                  "softmax_scale"])
def test_pattern_large_bf16(name, rows, n):
    args = make_args(name, rows, n, torch.bfloat16, "cuda")
    out, reports = compile_and_run(PATTERNS[name], args)
    assert kernel_count(reports) == 1
    for i, (a, e) in enumerate(zip(as_tuple(out), as_tuple(PATTERNS[name](*args)))):
        if e.dtype == torch.float8_e4m3fn:
            assert_fp8_matches(a, e, min_equal=0.999)
        else:
            assert_close(a, e, name=f"{name}[{i}]")


@pytest.mark.parametrize("name, dtype", [("dequant_add", torch.bfloat16),
                                         ("mul_add", torch.bfloat16), ("mul_add", torch.float16)])
def test_elementwise_chains_give_eagers_bits(name, dtype):
    """Ops eager runs one by one, each rounding its result to bf16 / fp16: the fused kernel
    rounds at the same places, so every bit matches (the GPU compiler must not contract a
    rounded product with the add that reads it: tests/test_ptx.py)."""
    def mul_add(a, b, c):
        return a * b + c
    fn = mul_add if name == "mul_add" else PATTERNS[name]
    if name == "mul_add":
        args = tuple(torch.randn(333, 4099, device="cuda", dtype=dtype) for _ in range(3))
    else:
        args = make_args(name, 333, 4099, dtype, "cuda")
    out, reports = compile_and_run(fn, args)
    assert kernel_count(reports) == 1
    expected = fn(*args)
    same = (out.view(torch.int16) == expected.view(torch.int16)).float().mean().item()
    assert same == 1.0, f"{name} {dtype}: {100 * (1 - same):.3f}% of elements differ from eager"


class AddEps(torch.nn.Module):
    """A float attribute: with dynamic=True dynamo passes it as a 0-dim CPU tensor."""

    def __init__(self):
        super().__init__()
        self.eps = 1e-6

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def test_cpu_scalar_joins_gpu_kernel():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    out, reports = compile_and_run(AddEps(), (x,), dynamic=True)
    assert kernel_count(reports) == 1
    assert_close(out, AddEps()(x))


def test_lean_relaunch_follows_alignment_and_size_changes():
    """Repeat launches skip Triton's binding; a misaligned view or a size of another
    divisibility class must still get a kernel specialized for it, never the cached one."""
    torch._dynamo.reset()
    fn = torch.compile(lambda g, u: PATTERNS["swiglu"](g, u), backend="fusion", dynamic=True)
    base_g = torch.randn(4096 + 1, device="cuda", dtype=torch.bfloat16)
    base_u = torch.randn(4096 + 1, device="cuda", dtype=torch.bfloat16)
    for start, n in [(0, 4096), (0, 4096), (1, 4096), (1, 4095), (0, 4096), (1, 4000)]:
        g, u = base_g[start:start + n], base_u[start:start + n]   # start=1: 2-byte aligned
        assert_close(fn(g, u), PATTERNS["swiglu"](g, u), name=f"start={start} n={n}")


def test_kernels_launch_through_torchs_launcher_without_building_tritons():
    """The generated launchers launch through torch's prebuilt launcher (no C compiler run for
    Triton's per-signature launcher): each relaunch entry kept is torch's, over sizes that
    change (dynamic rows) and three dtypes, and the results match eager on every call."""
    import triton.runtime.build as build

    from fusion_compiler import backend

    def modules():
        return {id(m): m for cache in backend._caches.values() for m in cache._modules[False].values()}
    before = set(modules())
    built = []
    real = build._build
    build._build = lambda *a, **kw: built.append(a[0]) or real(*a, **kw)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            torch._dynamo.reset()
            fn = torch.compile(PATTERNS["add_rmsnorm"], backend="fusion", dynamic=True)
            for rows in (37, 64, 1000, 64):
                args = make_args("add_rmsnorm", rows, 1003, dtype, "cuda")
                for a, e in zip(as_tuple(fn(*args)), as_tuple(PATTERNS["add_rmsnorm"](*args))):
                    assert_close(a, e, name=f"{dtype} rows={rows}")
    finally:
        build._build = real
    entries = [e for i, m in modules().items() if i not in before
               for name, table in vars(m).items() if name.startswith("_COMPILED_")
               for e in table.values()]
    assert entries and all(e[0] is None for e in entries), "a kernel went through Triton's launcher"
    assert not [b for b in built if "launcher" in str(b)], built


def _tiny_llama():
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "examples"))
    from llama import make_model_and_inputs
    return make_model_and_inputs(device="cuda", dtype=torch.bfloat16, batch=2, seq=16)


def test_cudagraphs_replay_matches_eager_and_copied_outputs_stay_valid():
    model, (ids,) = _tiny_llama()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fusion",
                       options={"cudagraphs": True, "cudagraph_copy_outputs": True})
    with torch.no_grad():
        outs, refs = [], []
        for step in range(5):
            x = torch.randint(0, 256, ids.shape, device="cuda")
            outs.append(fn(x))
            refs.append(model(x))
        for step, (o, r) in enumerate(zip(outs, refs)):      # earlier results still valid
            assert_close(o, r, name=f"step {step}")
        # weights moved to new storage: the graph is captured again, results stay right
        model.lm_head.weight.data = model.lm_head.weight.data * 0.5
        x = torch.randint(0, 256, ids.shape, device="cuda")
        assert_close(fn(x), model(x), name="after new weights")


def test_cudagraph_outputs_are_valid_until_the_next_call_then_raise():
    """mode="reduce-overhead": outputs are the graph's memory, as with Inductor. Each is right
    until the next call; then reading it, or a view of it, raises and says to clone; a clone
    stays right. A capture made again (weights moved) frees the old memory: same error."""
    model, (ids,) = _tiny_llama()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fusion", mode="reduce-overhead")

    def call():
        x = torch.randint(0, 256, ids.shape, device="cuda")
        out = fn(x)
        expected = model(x)
        assert_close(out, expected)
        return out, expected

    with torch.no_grad():
        call()                                   # a plain call (kernels compile), then
        call()                                   # the capture and its first replay
        out, expected = call()                   # a replay
        last, kept = out[:, -1], out.clone()     # a view and a clone the caller made
        call()
        for stale in (out, last):
            with pytest.raises(RuntimeError, match=r"overwritten\. Clone it \(out\.clone\(\)\)"):
                stale.float().sum().item()
        assert_close(kept, expected, name="clone")
        out, _ = call()
        model.lm_head.weight.data = model.lm_head.weight.data * 0.5    # captured again
        call()
        with pytest.raises(RuntimeError, match="overwritten"):
            out.float().sum().item()


class _TwoGraphs(torch.nn.Module):
    """Two matmuls with a graph break between them: two captured graphs, each using cuBLAS."""

    def __init__(self, n=256):
        super().__init__()
        self.a, self.b = torch.nn.Linear(n, n), torch.nn.Linear(n, n)

    def forward(self, x):
        h = torch.relu(self.a(x)) + 1
        torch._dynamo.graph_break()
        return torch.nn.functional.gelu(self.b(h)) * 2


def test_cudagraph_captured_again_leaves_other_graphs_right_and_memory_flat():
    """The first graph's weights move twice, so it is captured again (its old graph freed)
    while the second graph keeps replaying. The second stays right: no graph bakes in a cuBLAS
    workspace another graph's pool owns (pytorch/pytorch#193402). And capturing again leaves
    nothing behind: no cuBLAS workspace per capture for a new warm-up stream."""
    model = _TwoGraphs().to("cuda", torch.bfloat16).eval()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fusion", mode="reduce-overhead")

    def call():
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        out = fn(x).clone()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()        # what the old graphs freed goes back to the driver
        assert_close(out, model(x))

    with torch.no_grad():
        for _ in range(3):
            call()                      # plain, captured, replayed
        reserved = torch.cuda.memory_reserved()
        for _ in range(2):
            model.a.weight.data = model.a.weight.data * 0.5
            call()                      # the first graph captured again; the second replays
            call()
        grown = torch.cuda.memory_reserved() - reserved
    assert grown < 8 << 20, f"{grown / 2**20:.0f} MiB more reserved after capturing again"


def test_cudagraphs_option_is_used_only_where_safe():
    model, (ids,) = _tiny_llama()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fusion", options={"cudagraphs": True}, dynamic=True)
    with torch.no_grad():
        for seq in (16, 24):
            x = torch.randint(0, 256, (2, seq), device="cuda")
            assert_close(fn(x), model(x), name=f"dynamic seq {seq}")


def _assert_close_by_rows(actual, expected, name, chunk=1 << 16):
    """assert_close over a huge tensor, a slab of rows at a time (bounded extra memory)."""
    for start in range(0, actual.shape[0], chunk):
        assert_close(actual[start:start + chunk], expected[start:start + chunk],
                     name=f"{name} rows {start}..")


def test_more_than_2_31_elements_use_64_bit_offsets():
    """Row and pointwise kernels over tensors past 2**31 elements (4 GiB each in bf16): the
    launcher switches on 64-bit indexing; the rows past the 2**31-th element are checked too."""
    n = 4096
    rows = (2**31) // n + 3
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    (normed, h), reports = compile_and_run(PATTERNS["add_rmsnorm"], (x, r, w))
    assert kernel_count(reports) == 1
    exp_normed, exp_h = PATTERNS["add_rmsnorm"](x, r, w)
    _assert_close_by_rows(normed, exp_normed, "normed")
    _assert_close_by_rows(h, exp_h, "h")
    del normed, h, exp_normed, exp_h
    out, reports = compile_and_run(PATTERNS["swiglu"], (x, r))
    assert kernel_count(reports) == 1
    _assert_close_by_rows(out, PATTERNS["swiglu"](x, r), "swiglu")
    del x, r, out
    torch.cuda.empty_cache()


def test_cpu_and_cuda_ops_mixed_in_one_graph():
    """The CUDA ops fuse; the CPU ops run on ATen on the CPU; the results meet on the GPU."""
    def f(x, y):
        a = (x * 2).relu() + 1
        b = torch.sin(y) * 3
        return a + b.to("cuda"), b

    x = torch.randn(37, 41, device="cuda")
    y = torch.randn(37, 41)
    (out, b), reports = compile_and_run(f, (x, y))
    exp_out, exp_b = f(x, y)
    assert kernel_count(reports) >= 1
    assert b.device.type == "cpu" and out.device.type == "cuda"
    assert_close(out, exp_out, name="cuda result")
    assert_close(b, exp_b, name="cpu result")


def test_one_kernel_module_serves_live_graphs_on_two_devices(monkeypatch):
    """A cached kernel module is shared by every graph with that kernel; the device is bound
    per graph. (It was a module global: the last graph compiled set it for all of them.)"""
    f = lambda x: (x * 2).relu() + 1  # noqa: E731
    torch._dynamo.reset()
    on_gpu = torch.compile(f, backend="fusion", fullgraph=True)
    xg = torch.randn(37, 41, device="cuda")
    assert_close(on_gpu(xg), f(xg))
    monkeypatch.setenv("FUSION_COMPILER_EMIT_SOURCES", "1")     # the CPU graph generates too
    on_cpu = torch.compile(lambda x: f(x), backend="fusion", fullgraph=True)
    xc = torch.randn(37, 41)
    assert_close(on_cpu(xc), f(xc))
    out = on_gpu(xg)
    assert out.device.type == "cuda"
    assert_close(out, f(xg))
