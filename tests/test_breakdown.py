"""`bench --breakdown`: kernel names to categories, time per category over a call's GPU span,
the table and the JSON, and the CLI flag. Synthetic traces: no GPU needed."""
import io
import json
import re

import pytest

from fusion_compiler import bench
from fusion_compiler.breakdown import (CATEGORIES, Kernel, all_fused, category, format_table,
                                       format_tables, summarize)
from fusion_compiler.cli import main

from conftest import HAS_CUDA

# names as a profiler trace (demangled) shows them on A100/H100/H200
NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cublas": "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
    "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
    "__nv_bfloat16, true, false, false>(cublasLt::cublasSplitKParams<float>, float const*, "
    "__nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*, "
    "float const*, __nv_bfloat16*, void*, long, float*, int*)": "gemm",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, "
    "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
    "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, "
    "float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
    "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, "
    "float>, float, float)": "gemm",
    # a convolution: `fprop` does not make it attention
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_"
    "warpgroupsize1x1x1_g1_execute_kernel__5x_cudnn": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "matmul_kernel": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_"
    "cga1x1x1_kernel0_0": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
    "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, "
    "false, false, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)":
        "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<"
    "128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, "
    "128, 8, cutlass::bfloat16_t> >, false, false, false, false, false, false, false, false>"
    "(pytorch_flash::Flash_bwd_params)": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
    "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)":
        "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "_pointwise_kernel": "fused",
    "_persistent_kernel": "fused",
    "_looped_kernel": "fused",
    "_split0_kernel": "fused",
    "_split12_kernel": "fused",
    "triton_per_fused__softmax_0": "fused",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "fused",
    # Inductor names kernels after the ATen ops they hold: this one is SDPA's input copy
    "triton_poi_fused__scaled_dot_product_efficient_attention_transpose_view_2": "fused",
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, "
    "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, "
    "std::array<char*, 3ul> >(int, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
    "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)":
        "aten",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<"
    "float, float, float, float>, unsigned int, c10::BFloat16, 4> >(at::native::ReduceOp<float, "
    "at::native::MeanOps<float, float, float, float>, unsigned int, c10::BFloat16, 4>)": "aten",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, "
    "c10::BFloat16, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(c10::BFloat16*, "
    "c10::BFloat16 const*, int)": "aten",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() "
    "const::{lambda()#7}::operator()() const::{lambda(float)#1}> >(int, "
    "at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() "
    "const::{lambda(float)#1}>)": "aten",
    "Memcpy DtoD (Device -> Device)": "aten",
    "Memset (Device)": "aten",
}

GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
ATTENTION = "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, ...>"

# two streams: a GEMM [0, 10) and attention [5, 15) overlap by 5 us; then our kernel
# [20, 30) and an ATen one [32, 35). Span 35, busy 15 + 10 + 3 = 28, gaps 5 + 2 = 7
OVERLAPPING = [Kernel("_persistent_kernel", 20.0, 10.0), Kernel(GEMM, 0.0, 10.0),
               Kernel(ATTENTION, 5.0, 10.0), Kernel(ELEMENTWISE, 32.0, 3.0)]


def us(result):
    return {cat: round(row["us"], 9) for cat, row in result["categories"].items()}


def parse(table):
    """{label: (us, share %, kernels, floor)} from the rows of a breakdown table."""
    rows = {}
    for line in table.splitlines()[2:]:
        m = re.fullmatch(r"  (.+?)\s+([\d.]+)\s+([\d.]+)%\s+(\d+)\s+(\S+)", line)
        assert m, f"not a row: {line!r}"
        rows[m[1]] = (float(m[2]), float(m[3]), int(m[4]), m[5])
    return rows


@pytest.mark.parametrize("name, expected", NAMES.items(), ids=lambda v: str(v)[:40])
def test_realistic_kernel_names_fall_into_their_category(name, expected):
    assert category(name) == expected


def test_mm_is_a_gemm_only_as_a_word():
    assert [category(n) for n in ("bmm_kernel", "_scaled_mm", "void mm<float>", "commit_kernel",
                                  "hammer_kernel")] == ["gemm", "gemm", "gemm", "aten", "aten"]


def test_overlapping_kernels_split_their_shared_time_and_gaps_are_the_idle_rest():
    result = summarize(OVERLAPPING)
    assert result["span_us"] == 35.0 and result["busy_us"] == 28.0 and result["kernels"] == 4
    assert us(result) == {"gemm": 7.5, "attention": 7.5, "fused": 10.0, "aten": 3.0, "gaps": 7.0}
    assert [result["categories"][c]["kernels"] for c in CATEGORIES] == [1, 1, 1, 1, 0]
    assert result["categories"]["gaps"]["share"] == pytest.approx(0.2)
    assert result["categories"]["fused"]["share"] == pytest.approx(10 / 35)


def test_disjoint_kernels_count_whole_and_gaps_sum_the_holes():
    # [10, 14) and [15, 20) fused, [26, 27) ATen: span 17, holes 1 + 6
    result = summarize([Kernel("_pointwise_kernel", 10.0, 4.0), Kernel("_looped_kernel", 15.0, 5.0),
                        Kernel("Memset (Device)", 26.0, 1.0)])
    assert result["span_us"] == 17.0 and result["busy_us"] == 10.0
    assert us(result) == {"gemm": 0.0, "attention": 0.0, "fused": 9.0, "aten": 1.0, "gaps": 7.0}
    assert result["categories"]["fused"]["kernels"] == 2
    assert result["categories"]["fused"]["share"] == pytest.approx(9 / 17)


def test_a_kernel_inside_another_and_kernels_touching_end_to_start():
    # [0, 10) GEMM holds [2, 4) ATen: 2 us shared; then [10, 12) fused starts as the GEMM ends
    result = summarize([Kernel(GEMM, 0.0, 10.0), Kernel(ELEMENTWISE, 2.0, 2.0),
                        Kernel("_pointwise_kernel", 10.0, 2.0)])
    assert us(result) == {"gemm": 9.0, "attention": 0.0, "fused": 2.0, "aten": 1.0, "gaps": 0.0}
    assert result["span_us"] == 12.0 and result["busy_us"] == 12.0


def test_a_kernel_of_no_duration_counts_but_takes_no_time():
    result = summarize([Kernel(GEMM, 0.0, 4.0), Kernel("Memset (Device)", 2.0, 0.0),
                        Kernel("_pointwise_kernel", 6.0, 2.0)])
    assert us(result) == {"gemm": 4.0, "attention": 0.0, "fused": 2.0, "aten": 0.0, "gaps": 2.0}
    assert result["categories"]["aten"]["kernels"] == 1 and result["kernels"] == 3


@pytest.mark.parametrize("kernels", [OVERLAPPING, OVERLAPPING[:1], OVERLAPPING[1:],
                                     [Kernel(n, 3.0 * i, 2.5) for i, n in enumerate(NAMES)]])
def test_shares_sum_to_one(kernels):
    result = summarize(kernels)
    assert sum(row["share"] for row in result["categories"].values()) == pytest.approx(1.0)
    assert sum(row["kernels"] for row in result["categories"].values()) == len(kernels)


def test_no_kernels_gives_zeros_not_nan():
    result = summarize([], fused_floor_us=5.0)
    assert result["span_us"] == 0.0 and result["kernels"] == 0
    assert all(row == {"us": 0.0, "kernels": 0, "share": 0.0, "floor_frac": None}
               for row in result["categories"].values())
    assert parse(format_table("toy", "fusion", result))["gaps"] == (0.0, 0.0, 0, "-")


def test_floor_is_reported_for_the_fused_kernels_only_when_known():
    known = summarize(OVERLAPPING, fused_floor_us=5.0)     # 5 us of floor in 10 us of fused
    assert known["categories"]["fused"]["floor_frac"] == 0.5
    assert [known["categories"][c]["floor_frac"] for c in ("gemm", "attention", "aten", "gaps")] \
        == [None] * 4
    assert summarize(OVERLAPPING)["categories"]["fused"]["floor_frac"] is None
    # no fused kernel: nothing to compare the floor with
    assert summarize(OVERLAPPING[1:], 5.0)["categories"]["fused"]["floor_frac"] is None


def test_all_fused_only_when_every_kernel_is_generated():
    assert all_fused([Kernel("_pointwise_kernel", 0, 1),
                      Kernel("triton_per_fused__softmax_0", 1, 1)])
    assert not all_fused([Kernel("_pointwise_kernel", 0, 1), Kernel("Memset (Device)", 1, 1)])
    assert not all_fused([])


def test_table_labels_fused_with_the_backend_and_shows_every_category():
    table = format_table("add_rmsnorm", "inductor", summarize(OVERLAPPING, fused_floor_us=5.0))
    assert table.splitlines()[0] == "add_rmsnorm / inductor: GPU span 35.0us, 4 kernels"
    assert parse(table) == {"gemm": (7.5, 21.4, 1, "-"), "attention": (7.5, 21.4, 1, "-"),
                            "fused (inductor)": (10.0, 28.6, 1, "50%"),
                            "aten": (3.0, 8.6, 1, "-"), "gaps": (7.0, 20.0, 0, "-")}
    assert "fused" in parse(format_table("add_rmsnorm", "eager", summarize(OVERLAPPING)))


def test_run_prints_a_breakdown_per_target_and_backend_and_writes_it_to_json(
        monkeypatch, tmp_path, capsys):
    """bench.run with the GPU parts replaced: the wiring from measure to table and JSON."""
    import torch

    def fake_measure(fn, make, backend, mode, floor, ref, breakdown, held_at_start=None):
        assert breakdown is True
        row = {"backend": backend, "ms": 0.035 if backend == "eager" else 0.025,
               "cold_compile_s": 0.0, "warm_compile_s": None,
               "peak_mem_bytes": 0, "max_err_vs_eager": None}
        return row, None, None, lambda: {"kernels_per_call": 4,
                                         "breakdown": summarize(OVERLAPPING)}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(bench, "_copy_bandwidth", lambda: 4.0e12)
    monkeypatch.setattr(bench, "measure", fake_measure)
    path = tmp_path / "bench.json"
    bench.run([("toy", None, None, False)], ("eager", "fusion"), out_path=path,
              breakdown=True)
    out = capsys.readouterr().out
    main_table, tables = out.split("\n\n", 1)
    assert "toy" in main_table and "GPU span" not in main_table
    assert [t.splitlines()[0] for t in tables.strip().split("\n\n")] == [
        "toy / eager: GPU span 35.0us, 4 kernels", "toy / fusion: GPU span 35.0us, 4 kernels"]
    doc = json.loads(path.read_text())
    gaps = doc["targets"]["toy"]["fusion"]["breakdown"]["categories"]["gaps"]
    assert gaps == {"us": 7.0, "kernels": 0, "share": 0.2, "floor_frac": None}
    assert format_tables(doc["targets"]) == tables.strip()


def _fake_rows(monkeypatch, eager_rounds=(3.0, 1.0, 2.0, 9.0, 2.0)):
    """bench.run with measure and do_bench replaced: eager takes ``eager_rounds`` ms in its
    rounds, fusion 1.5 ms in each; returns the order of the timed calls and the profiles."""
    import torch
    import triton.testing

    order, eager_ms = [], iter(eager_rounds)

    def fake_measure(fn, make, backend, mode, floor, ref, breakdown, held_at_start=None):
        row = {"backend": backend, "ms": 5.0, "cold_compile_s": 0.0, "warm_compile_s": None,
               "peak_mem_bytes": 0, "max_err_vs_eager": None}
        return row, None, lambda: backend, \
            lambda: order.append(f"profile {backend}") or {"kernels_per_call": 4}

    def fake_do_bench(fn, warmup, rep, return_mode):
        order.append(fn())
        return next(eager_ms) if order[-1] == "eager" else 1.5

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(bench, "_copy_bandwidth", lambda: 4.0e12)
    monkeypatch.setattr(bench, "measure", fake_measure)
    return order


def test_latency_is_the_median_of_interleaved_rounds_and_profiling_comes_last(monkeypatch,
                                                                             tmp_path):
    """The profiler runs after every timed call: a profiler session slows later calls of the
    same process (GPT-2 with fusion on the H200: 2.54 -> 3.81 ms)."""
    order = _fake_rows(monkeypatch)
    doc = bench.run([("toy", None, None, False)], ("eager", "fusion"),
                    out_path=tmp_path / "b.json")
    assert order == ["eager", "fusion", "fusion", "eager"] * 2 + ["eager", "fusion"] \
        + ["profile eager", "profile fusion"]
    eager, fusion = doc["targets"]["toy"]["eager"], doc["targets"]["toy"]["fusion"]
    assert eager["ms"] == 2.0 and eager["ms_rounds"] == [3.0, 1.0, 2.0, 9.0, 2.0]
    assert eager["ms_alone"] == 5.0 and fusion["ms"] == 1.5
    assert fusion["speedup_vs_eager"] == pytest.approx(2.0 / 1.5)
    assert fusion["kernels_per_call"] == 4 and json.loads((tmp_path / "b.json").read_text())


def test_every_target_is_timed_before_any_is_profiled(monkeypatch):
    order = _fake_rows(monkeypatch, eager_rounds=[2.0] * 10)
    bench.run([("a", None, None, False), ("b", None, None, False)], ("eager", "fusion"))
    profiled = [i for i, o in enumerate(order) if o.startswith("profile")]
    assert len(order) == 24 and profiled == [20, 21, 22, 23], order


@pytest.mark.parametrize("flag, expected", [(["--breakdown"], (True, 5)), ([], (False, 5)),
                                           (["--rounds", "12"], (False, 12))])
def test_the_flags_reach_bench_run(monkeypatch, flag, expected):
    import torch
    seen = {}

    def fake_run(targets, backends, mode, out_path, breakdown=False, rounds=None):
        seen.update(targets=[t[0] for t in targets], breakdown=breakdown, rounds=rounds)
        return {"targets": {}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", fake_run)
    assert main(["bench", "add_rmsnorm", *flag]) == 0
    assert seen == {"targets": ["add_rmsnorm"], "breakdown": expected[0], "rounds": expected[1]}


@pytest.mark.parametrize("value", ["0", "-3", "many", "2.5"])
def test_bench_rejects_a_bad_number_of_rounds(capsys, value):
    assert main(["bench", "add_rmsnorm", "--rounds", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fusion-compiler: error: argument --rounds: "
                                               f"{value!r} is not a whole number of rounds (1 or more)")


def test_paired_rounds_are_fusion_minus_each_other_backend():
    """Each fusion backend against eager and Inductor; plain fusion also against its variants."""
    times = {"eager": [10.0, 12.0, 11.0, 30.0], "inductor": [5.0, 7.0, 6.0, 5.5],
             "fusion": [4.9, 7.2, 5.7, 5.4], "fusion-cg": [4.0, 4.0, 4.0, 4.0]}
    got = bench.paired(times)
    assert sorted(got) == ["fusion", "fusion-cg"]
    assert sorted(got["fusion"]) == ["eager", "fusion-cg", "inductor"]
    assert sorted(got["fusion-cg"]) == ["eager", "inductor"]
    assert got["fusion"]["fusion-cg"]["faster_rounds"] == 0
    ind = got["fusion"]["inductor"]
    # differences -0.1, +0.2, -0.3, -0.1: median of the even count -0.1, 3 of 4 faster
    assert ind["median_diff_ms"] == pytest.approx(-0.1)
    assert ind["median_diff_frac"] == pytest.approx(-0.1 / 5.75)
    assert (ind["faster_rounds"], ind["rounds"]) == (3, 4)
    assert got["fusion-cg"]["eager"]["faster_rounds"] == 4
    assert bench.paired({"eager": [1.0], "inductor": [2.0]}) == {}


def test_bench_run_prints_and_stores_the_paired_rounds(monkeypatch, tmp_path, capsys):
    order = _fake_rows(monkeypatch, eager_rounds=[3.0, 1.0, 2.0])
    doc = bench.run([("toy", None, None, False)], ("eager", "fusion"),
                    out_path=tmp_path / "b.json", rounds=3)
    assert order.count("eager") == 3 and order.count("fusion") == 3
    assert doc["targets"]["toy"]["eager"]["ms_rounds"] == [3.0, 1.0, 2.0]
    p = doc["targets"]["toy"]["fusion"]["paired"]["eager"]
    assert p == {"median_diff_ms": pytest.approx(-0.5), "median_diff_frac": pytest.approx(-0.25),
                 "faster_rounds": 2, "rounds": 3}
    assert "paired" not in doc["targets"]["toy"]["eager"]
    out = capsys.readouterr().out
    assert "toy: fusion - eager per round: median -500.0us (-25.0%), fusion faster in 2 of 3 " \
        "rounds" in out
    assert json.loads((tmp_path / "b.json").read_text())["targets"]["toy"]["fusion"]["paired"]
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bench.run([("toy", None, None, False)], ("eager", "fusion"), rounds=0)


def test_bench_without_eager_prints_its_table(monkeypatch, capsys):
    """No eager column: no speedup to print (session 46's first ResNet call failed here)."""
    _fake_rows(monkeypatch)
    doc = bench.run([("toy", None, None, False)], ("fusion", "fusion-nchw"), rounds=2)
    assert doc["targets"]["toy"]["fusion"]["speedup_vs_eager"] is None
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("toy ")]
    assert [(r[1], r[3]) for r in rows] == [("fusion", "-"), ("fusion-nchw", "-")]
    assert doc["targets"]["toy"]["fusion"]["paired"]["fusion-nchw"]["rounds"] == 2


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is visible: bench would run")
def test_bench_breakdown_without_a_gpu_says_so(capsys):
    assert main(["bench", "add_rmsnorm", "--breakdown"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA GPU" in err[0]
    assert err[0].startswith("fusion-compiler: error:")


def test_bench_table_shows_reserved_and_allocated_peak_memory():
    """The main table's two memory columns, in MiB: reserved (``peak MB``) and the call's own
    allocated tensors (``alloc MB``), the latter "-" for a row measured without it."""
    row = {"ms": 2.0, "speedup_vs_eager": 1.5, "kernels_per_call": 7, "cold_compile_s": 1.0,
           "warm_compile_s": None, "peak_mem_bytes": 88 * 2**20, "max_err_vs_eager": 0.01}
    results = {"copy_TBps": 4.2, "mode": "inference", "targets": {
        "bert": {"fusion": dict(row, peak_allocated_bytes=37 * 2**20), "eager": row}}}
    header, *lines = bench.format_table(results).splitlines()[1:]
    cells = [dict(zip(header.replace("peak MB", "peak_MB").replace("alloc MB", "alloc_MB")
                      .replace("max err", "max_err").replace("cold s", "cold_s")
                      .replace("warm s", "warm_s").replace("floor %", "floor").split(),
                      line.split())) for line in lines]
    assert [(c["backend"], c["peak_MB"], c["alloc_MB"]) for c in cells] == [
        ("fusion", "88", "37"), ("eager", "88", "-")]


def test_a_backend_that_fails_gets_a_row_and_the_others_are_timed(monkeypatch, tmp_path,
                                                                  capsys):
    """Inductor failed to compile transformers' Mamba2 (torch 2.11, H100: "InductorError:
    TypeError: list indices must be integers or slices, not NoneType") and the whole bench
    stopped with it: now its row says why, eager and fusion are timed and paired, and the
    command exits 1 naming what failed."""
    order = _fake_rows(monkeypatch, eager_rounds=[3.0, 1.0, 2.0])
    measure = bench.measure

    def failing(fn, make, backend, *args, **kw):
        if backend == "inductor":
            raise RuntimeError("InductorError: TypeError: list indices must be integers\nmore")
        return measure(fn, make, backend, *args, **kw)
    monkeypatch.setattr(bench, "measure", failing)
    progress = io.StringIO()
    doc = bench.run([("toy", None, None, False)], ("eager", "inductor", "fusion"),
                    out_path=tmp_path / "b.json", progress=progress, rounds=3)
    rows = doc["targets"]["toy"]
    assert rows["inductor"] == {"failed": "RuntimeError: InductorError: TypeError: list "
                                          "indices must be integers"}
    assert rows["fusion"]["ms"] == 1.5 and rows["fusion"]["speedup_vs_eager"] == 2.0 / 1.5
    assert sorted(rows["fusion"]["paired"]) == ["eager"]
    assert bench.failed(doc) == [("toy", "inductor")]
    assert "inductor" not in order and order.count("fusion") == 3
    assert "toy: inductor failed: RuntimeError: InductorError" in progress.getvalue()
    table = capsys.readouterr().out.splitlines()
    assert any(line.split()[:3] == ["toy", "inductor", "failed:"] for line in table)
    assert json.loads((tmp_path / "b.json").read_text())["targets"]["toy"]["inductor"]["failed"]


def test_the_command_exits_1_when_a_backend_failed(monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", lambda *a, **k: {
        "targets": {"add_rmsnorm": {"inductor": {"failed": "X: y"}, "fusion": {"ms": 1.0}}}})
    assert main(["bench", "add_rmsnorm"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fusion-compiler: error: bench: failed on add_rmsnorm (inductor); the table "
                   "has the other backends' numbers"]
