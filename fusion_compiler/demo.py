"""What each example's ``main()`` does: compile it, compare with eager, say what was fused.

    python examples/llama.py   ->   fusion_compiler.demo.run_example(make_model_and_inputs, ...)
"""
from __future__ import annotations

import torch


def run_example(make_model_and_inputs, target: str, output: str = "output",
                on_aten: str = "GEMM, attention, embedding", atol=1e-4, rtol=1e-4) -> int:
    """Build the example's model on the GPU if there is one, run it eagerly and compiled with
    the fusion backend, print the difference and one line per compiled graph; 0 if they match
    and nothing fell back to ATen because of a compiler error."""
    from .report import capture_compiles

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model, inputs = make_model_and_inputs(device=device)
    model.eval()
    with torch.no_grad():
        expected = model(*inputs)
        with capture_compiles() as reports:
            actual = torch.compile(model, backend="fusion")(*inputs)
    diff = (actual.float() - expected.float()).abs().max().item()
    print(f"device {device}: {output} {tuple(actual.shape)}, max abs diff vs eager {diff:.3g}")
    for i, r in enumerate(reports):
        if r.error:
            print(f"graph {i} ({r.kind}): the compiler failed, so it ran on ATen unfused: {r.error}")
            continue
        t = r.summary["totals"]
        ran = "ran" if r.ran_kernels else "planned (CPU: the ATen graph ran; a GPU runs them)"
        print(f"graph {i} ({r.kind}): {t['kernels_before']} fusible ops -> {t['kernels_after']} "
              f"fused kernels {ran}; {t['aten_ops']} ops left on ATen ({on_aten}); "
              f"est. {t['time_before_us']:.0f} us -> {t['time_after_us']:.0f} us")
    print(f"details: fusion-compiler dump {target}")
    ok = torch.allclose(actual.float(), expected.float(), atol=atol, rtol=rtol)
    print("OK" if ok else "MISMATCH")
    return 0 if ok and not any(r.error for r in reports) else 1
