"""The launch path of the generated launchers (codegen/launch.py): the lean relaunch through
Triton's C launch function, torch's prebuilt launcher (entries, fallbacks, the first launch)
with fakes in place of the GPU, and the relaunch key."""
from __future__ import annotations

import pytest
import torch


def test_direct_relaunch_calls_tritons_c_launch_function_or_goes_through_run():
    """A kernel without scratch memory whose launcher is the C function is relaunched through
    that function; any other goes through the compiled kernel's `run`, with the same arguments
    Triton's own launch passes."""
    from fusion_compiler.codegen.launch import direct_entry

    calls = []

    class Launcher:
        launch, global_scratch_size, profile_scratch_size = max, 0, 0
        launch_cooperative_grid, launch_pdl = 0, 1

    class Compiled:
        function, packed_metadata = 1234, (4, 1, 0)
        run = Launcher()
    entry = direct_entry(Compiled())
    assert entry[0] is max and entry[1:5] == (1234, False, True, (4, 1, 0))

    class Scratch(Launcher):             # scratch memory: Triton's __call__ allocates it
        global_scratch_size = 128

        def __call__(self, *args):
            calls.append(args)

    class CompiledScratch(Compiled):
        run = Scratch()
    entry = direct_entry(CompiledScratch())
    assert entry[0] is not max
    entry[0](7, 1, 1, "stream", entry[1], entry[2], entry[3], None, None, entry[4], None, None,
             None, 111, 222)
    assert calls == [(7, 1, 1, "stream", 1234, (4, 1, 0), None, None, None, 111, 222)]


def test_lean_launch_table_is_kept_only_without_launch_hooks(monkeypatch):
    """The GPU path stores compiled kernels for direct relaunch; a Triton launch hook (a
    profiler) must keep every launch going through Triton instead."""
    from triton import knobs

    from fusion_compiler.codegen import launch
    monkeypatch.setattr(launch, "LEAN", True)

    class Compiled:
        function = object()
        packed_metadata = (4, 1, 0)
        run = type("Launcher", (), {"launch": max, "global_scratch_size": 0,
                                    "profile_scratch_size": 0, "launch_cooperative_grid": False,
                                    "launch_pdl": False})()
    table = {}
    launch.remember(table, ("k",), Compiled())
    assert ("k",) in table
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):                  # Triton 3.5+: a chain of hooks, empty by default
        fn = lambda *a: None  # noqa: E731
        hook.add(fn)
        try:
            table.clear()
            launch.remember(table, ("k",), Compiled())
            assert table == {}
        finally:
            hook.remove(fn)
    monkeypatch.setattr(launch, "LEAN", False)    # the interpreter: never stored
    launch.remember(table, ("i",), Compiled())
    assert ("i",) not in table


class _Meta:
    """Triton 3.6-like kernel metadata (a namedtuple there)."""
    name, num_warps, shared, num_ctas = "k_fn", 4, 1024, 1
    global_scratch_size, profile_scratch_size = 0, 0
    launch_cooperative_grid, launch_pdl = False, False


def _compiled(signature, **meta):
    md = type("Meta", (_Meta,), meta)()
    src = type("Src", (), {"signature": signature})()
    return type("Compiled", (), {"metadata": md, "src": src,
                                 "metadata_group": {"k_fn.json": "/c/k.json",
                                                    "k_fn.cubin": "/c/k.cubin"}})()


@pytest.fixture
def static_launcher(monkeypatch):
    """torch's static launcher, faked: records loads and launches."""
    from fusion_compiler.codegen import launch
    calls = {"load": [], "launch": [], "registers": 40}

    class Static:
        @staticmethod
        def _load_kernel(path, name, shared, device):
            calls["load"].append((path, name, shared, device))
            return ("module", "function", calls["registers"], 0)    # torch 2.12+: module first

        @staticmethod
        def _launch_kernel(*args):
            calls["launch"].append(args)
    monkeypatch.setattr(launch, "_STATIC", Static)
    monkeypatch.setattr(launch, "launch_static", Static._launch_kernel)
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "raw_stream", lambda dev: 77)
    monkeypatch.setattr(launch, "_max_shared", lambda dev: 232448)
    return calls


SIG = {"in0": "*bf16", "out0": "*bf16", "R": "i32", "N": "i32", "XBLOCK": "constexpr",
       "RBLOCK": "constexpr", "INDEX64": "constexpr"}


def test_static_launch_entry_types_and_scratch_pointers(static_launcher):
    from fusion_compiler.codegen import launch
    entry = launch.static_entry(_compiled(SIG), 4)
    assert entry[0] is None and entry[1:5] == ("function", 4, 1024, "OOiiOO")
    assert entry[5] == (None, None)         # a null pointer per kind of scratch memory
    assert static_launcher["load"] == [("/c/k.cubin", "k_fn", 1024, 0)]
    # an older Triton without scratch arguments: none appended
    old = _compiled(SIG)
    old.metadata = type("Meta", (), {k: getattr(_Meta, k) for k in (
        "name", "num_warps", "shared", "num_ctas")})()
    assert launch.static_entry(old, 4)[4:6] == ("OOii", ())


@pytest.mark.parametrize("why, compiled, nargs", [
    ("scratch memory", _compiled(SIG, global_scratch_size=64), 4),
    ("profile scratch", _compiled(SIG, profile_scratch_size=8), 4),
    ("two CTAs", _compiled(SIG, num_ctas=2), 4),
    ("cooperative", _compiled(SIG, launch_cooperative_grid=True), 4),
    ("too much shared memory", _compiled(SIG, shared=300000), 4),
    ("an argument specialized to a constant (== 1)", _compiled(dict(SIG, N="constexpr")), 4),
    ("an odd argument type", _compiled(dict(SIG, N="nvTmaDesc")), 4),
])
def test_kernels_torchs_launcher_cannot_take_go_through_triton(static_launcher, why, compiled,
                                                               nargs):
    from fusion_compiler.codegen import launch
    assert launch.static_entry(compiled, nargs) is None, why


def test_kernel_with_more_registers_than_a_block_has_goes_through_triton(static_launcher):
    from fusion_compiler.codegen import launch
    assert launch.static_entry(_compiled(SIG, num_warps=32), 4) is not None   # 40 x 1024 fit
    static_launcher["registers"] = 80                                        # 80 x 1024 do not
    assert launch.static_entry(_compiled(SIG, num_warps=32), 4) is None


def test_first_launch_launches_through_torch_and_keeps_the_entry(static_launcher):
    from fusion_compiler.codegen import launch
    warmed = []

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            warmed.append((args, grid, kwargs))
            return _compiled(SIG)

        def __getitem__(self, grid):
            raise AssertionError("Triton's launch path taken")
    x = torch.empty(3, 5)
    table = {}
    launch.first_launch(table, ("key",), Kernel(), 6, x, x, 3, 5, XBLOCK=1, num_warps=4)
    assert warmed == [((x, x, 3, 5), (6,), {"XBLOCK": 1, "num_warps": 4})]
    entry = table[("key",)]
    assert entry[0] is None
    assert static_launcher["launch"] == [("function", 6, 1, 1, 4, 1024, "OOiiOO",
                                          (x.data_ptr(), x.data_ptr(), 3, 5, None, None), 77)]
    # with a Triton launch hook set (a profiler), Triton launches it and it is not kept
    from triton import knobs
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        launched = []

        class Traced(Kernel):
            def __getitem__(self, grid):
                return lambda *a, **kw: launched.append(grid)
        fn = lambda *a: None  # noqa: E731
        hook.add(fn)
        try:
            table.clear()
            launch.first_launch(table, ("key",), Traced(), 6, x, x, 3, 5, XBLOCK=1)
        finally:
            hook.remove(fn)
        assert launched == [(6,)] and table == {}


def test_relaunch_key_holds_each_runtime_integers_width(cache_dir, device):
    """The direct relaunch passes integers as the kernel was compiled for them (i32 below
    2**31, i64 from it, as Triton's own key tells apart): every integer the launcher passes
    that is not fixed in the kernel has its width in the key; fixed sizes need none."""
    from helpers import compile_and_run
    from patterns import PATTERNS, make_args

    def sources():
        return {p: p.read_text() for p in cache_dir.rglob("*.py")}
    args = make_args("add_rmsnorm", 37, 40, torch.float32, device)
    compile_and_run(PATTERNS["add_rmsnorm"], args)                    # static shapes
    (static,) = sources().values()
    assert "R > 2147483647" not in static and "N > 2147483647" not in static
    compile_and_run(PATTERNS["add_rmsnorm"], args, dynamic=True)      # rows and length symbolic
    (dynamic,) = [t for t in sources().values() if t != static]
    keys = [ln.strip() for ln in dynamic.splitlines() if ln.strip().startswith("key = (")]
    assert keys and all("R > 2147483647" in k and "N > 2147483647" in k for k in keys)
    x = torch.randn(3, 70, device=device)
    compile_and_run(PATTERNS["swiglu"], (x, x.clone()), dynamic=True)
    (pointwise,) = [t for t in sources().values() if t not in (static, dynamic)]
    assert "numel > 2147483647" in pointwise


@pytest.mark.parametrize("shape, even", [((4, 512), True), ((16, 1024), True), ((3, 700), False),
                                         ((5, 9), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_kernel_drops_its_mask_only_where_its_blocks_tile_the_tensor(
        cache_dir, device, monkeypatch, shape, even, dtype):
    """EVEN (numel a multiple of BLOCK: every lane in range) makes the kernel's mask a constant,
    which Triton removes from the loads and stores; any other size keeps the bounds test. Both
    give eager's numbers."""
    from helpers import assert_close, compile_and_run, kernel_count
    from patterns import PATTERNS

    from fusion_compiler.codegen import launch
    seen = []
    real = launch.first_launch

    def spy(table, key, kernel, grid, *args, **kwargs):
        seen.append((kwargs["BLOCK"], kwargs["EVEN"]))
        return real(table, key, kernel, grid, *args, **kwargs)
    monkeypatch.setattr(launch, "first_launch", spy)
    g, u = (torch.randn(*shape, device=device, dtype=dtype) for _ in range(2))
    out, reports = compile_and_run(PATTERNS["swiglu"], (g, u))
    assert kernel_count(reports) == 1
    assert_close(out, PATTERNS["swiglu"](g, u), dtype)
    ((block, got),) = seen
    assert got is even and (g.numel() % block == 0) is even


@pytest.mark.parametrize("name, dtype, stream, block", [
    ("swiglu", torch.bfloat16, 4, 1024),        # two full-size bf16 inputs
    ("swiglu", torch.float32, 8, 1024),
    ("bias_gelu", torch.bfloat16, 2, 2048),     # one full-size input; the bias is broadcast
    ("bias_gelu", torch.float32, 4, 1024),
    ("dequant_add", torch.bfloat16, 3, 1024),   # int8 values and a bf16 residual; scales per column
])
def test_pointwise_block_follows_the_bytes_each_element_streams_in(
        cache_dir, device, monkeypatch, name, dtype, stream, block):
    """A pointwise launcher asks for its settings with the bytes per element it loads from
    inputs as large as its output (broadcast ones not counted); a program then loads about
    PROGRAM_BYTES of them: 2048 elements of one bf16 stream, 1024 of two. The numbers stay
    eager's."""
    from helpers import assert_close, compile_and_run, kernel_count
    from patterns import PATTERNS, make_args

    from fusion_compiler.codegen import launch
    seen = []
    real = launch.first_launch

    def spy(table, key, kernel, grid, *args, **kwargs):
        seen.append(kwargs["BLOCK"])
        return real(table, key, kernel, grid, *args, **kwargs)
    monkeypatch.setattr(launch, "first_launch", spy)
    args = make_args(name, 6, 1000, dtype, device)
    out, reports = compile_and_run(PATTERNS[name], args)
    assert kernel_count(reports) == 1
    assert_close(out, PATTERNS[name](*args), dtype)
    (source,) = [p.read_text() for p in cache_dir.rglob("*.py")]
    assert f"pointwise_settings(numel, {stream})" in source
    assert seen == [block] == [launch.pointwise_settings(6000, stream)[0]]


def test_pointwise_kernel_requests_every_input_before_computing(cache_dir, device):
    """A pointwise kernel's direct loads come first (every input requested before arithmetic
    waits on one); a load addressed by a loaded index (a gather's) stays after that index."""
    from helpers import assert_close, compile_and_run, kernel_count
    from patterns import PATTERNS, make_args

    args = make_args("swiglu", 5, 33, torch.bfloat16, device)
    out, reports = compile_and_run(PATTERNS["swiglu"], args)
    assert kernel_count(reports) == 1
    assert_close(out, PATTERNS["swiglu"](*args), torch.bfloat16)
    (source,) = [p.read_text() for p in cache_dir.rglob("*.py")]
    body = source[source.index("xmask = xindex < numel"):source.index("tl.store(")].splitlines()[1:]
    assert [ln.strip().split(" = ")[1][:10] for ln in body[:2]] == ["tl.load(in"] * 2
    assert all("tl.load(" not in ln for ln in body[2:])

    table = torch.randn(50, 33, device=device)
    idx = torch.randint(0, 50, (5,), device=device)
    bias = torch.randn(33, device=device)

    def embed_add(idx, table, bias):
        return torch.nn.functional.embedding(idx, table) + bias
    out, reports = compile_and_run(embed_add, (idx, table, bias))
    assert kernel_count(reports) == 1
    assert_close(out, embed_add(idx, table, bias), torch.float32)
    (source,) = [p.read_text() for p in cache_dir.rglob("*.py") if "embedding" in p.read_text()]
    lines = [ln.strip() for ln in source.splitlines() if "tl.load(" in ln]
    index_at = next(i for i, ln in enumerate(lines) if ln.startswith("x") and "in0 + " in ln)
    row_at = next(i for i, ln in enumerate(lines) if "in1 + " in ln)
    assert index_at < row_at


@pytest.mark.parametrize("hoist", [True, False])
@pytest.mark.parametrize("name, dtype, later", [
    ("add_rmsnorm", torch.bfloat16, ["in2"]),          # the weight row
    ("add_rmsnorm", torch.float32, ["in2"]),
    ("add_layernorm", torch.float16, ["in2", "in3"]),  # weight and bias rows
    ("rmsnorm_fp8", torch.bfloat16, ["in1"]),          # the weight row (the scale comes first)
    ("rmsnorm_dynamic_fp8", torch.bfloat16, ["in1"]),  # after both row reductions
])
def test_row_kernel_issues_its_later_loads_first_on_a_small_grid(
        cache_dir, device, monkeypatch, hoist, name, dtype, later):
    """A persistent row kernel's loads that come after its first reduction (a weight row) are
    issued at its start when the launcher's grid has few programs per SM (HOIST), and where
    they are otherwise; either way, one kernel and eager's numbers, on an odd shape."""
    from helpers import assert_close, as_tuple, compile_and_run, kernel_count
    from patterns import PATTERNS, make_args

    from fusion_compiler.codegen import launch
    seen = []
    real = launch.first_launch

    def spy(table, key, kernel, grid, *args, **kwargs):
        seen.append(kwargs.get("HOIST"))
        return real(table, key, kernel, grid, *args, **kwargs)
    monkeypatch.setattr(launch, "first_launch", spy)
    monkeypatch.setattr(launch, "few_programs", lambda grid: hoist)
    args = make_args(name, 7, 300, dtype, device)
    out, reports = compile_and_run(PATTERNS[name], args)
    assert kernel_count(reports) == 1
    for got, want in zip(as_tuple(out), as_tuple(PATTERNS[name](*args))):
        if want.dtype == torch.float8_e4m3fn:      # the quantized values: as bf16, one fp8 step
            assert_close(got.to(torch.bfloat16), want.to(torch.bfloat16), atol=0, rtol=0.125)
        else:
            assert_close(got, want, dtype if want.dtype == dtype else want.dtype)
    assert seen == [hoist]
    (source,) = [p.read_text() for p in cache_dir.rglob("*.py")]
    kernel = source[source.index("def _persistent_kernel"):source.index("_COMPILED_")]
    first_reduction = min(kernel.index(r) for r in ("tl.sum(", "fl.row_max(") if r in kernel)
    top, rest = kernel.index("if HOIST:"), kernel.index("if not HOIST:")
    assert top < first_reduction < rest
    for i in later:                 # in both places, nowhere else
        assert kernel.count(f"tl.load({i} + cols") == 2
        assert top < kernel.index(f"tl.load({i} + cols") < first_reduction
        assert rest < kernel.rindex(f"tl.load({i} + cols")


def test_row_kernel_without_later_loads_has_no_hoist_switch(cache_dir, device):
    """Softmax loads its row once, before its first reduction: no HOIST constexpr, no key part."""
    from helpers import assert_close, compile_and_run, kernel_count
    from patterns import PATTERNS, make_args

    args = make_args("softmax_scale", 5, 77, torch.bfloat16, device)
    out, reports = compile_and_run(PATTERNS["softmax_scale"], args)
    assert kernel_count(reports) == 1
    assert_close(out, PATTERNS["softmax_scale"](*args), torch.bfloat16)
    (source,) = [p.read_text() for p in cache_dir.rglob("*.py")]
    assert "HOIST" not in source


def test_few_programs_is_four_per_sm():
    from fusion_compiler.codegen import launch
    limit = launch.FEW_PROGRAMS_PER_SM * launch._sm_count()
    assert launch.few_programs(limit) and not launch.few_programs(limit + 1)
