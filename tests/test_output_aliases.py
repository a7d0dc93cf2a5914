"""A compiled graph's outputs are new tensors wherever eager's are, not views of tensors made
inside the graph: autograd marks a view that aot_autograd's function returns as the view of a
function with several outputs, and an in-place write into it then fails ("Output 0 of
CompiledFunction is a view and is being modified inplace"). wav2vec2 in training writes its
masked time steps into the feature projection's output after a graph break
(``hidden_states[mask] = ...``); it failed to compile on two such outputs:

* a kernel's output written over its dead input at another shape (launcher.inplace_outputs):
  the GEMM's [B*T, C] output read as [B, T, C]. It is now that memory made by
  ``launch.reinterpret``, not ``Tensor.view``;
* a matmul of a 3-d input returns ``_unsafe_view(mm)``, no view to autograd; the core
  decompositions made it a ``view``. It stays ``_unsafe_view`` (decompositions.py) and keeps
  its overload where it is a graph output (passes/fast_calls.py).

Each output is written in place, then trained through, against eager."""
import pytest
import torch

import fusion_compiler

from helpers import assert_close, compile_and_run, kernel_count
from patterns import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _projection(x, w, b):
    return torch.nn.functional.linear(x, w, b) * 2       # the GEMM's output written over


def _matmul(x, w, b):
    return x @ w.t()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn, kernels, inplace", [(_projection, 1, 1), (_matmul, 0, 0)],
                         ids=["written-over", "matmul"])
def test_an_output_is_written_in_place_and_trained(dtype, fn, kernels, inplace, device):
    x, w, b = (randn((3, 13, 24), dtype, device), randn((40, 24), dtype, device),
               randn((40,), dtype, device))
    mask = torch.rand(3, 13, device=device) > 0.5
    fill = randn((40,), dtype, device)

    def step(f, x, w, b):
        x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
        h = f(x, w, b)
        assert h._base is None, "a view of a tensor made inside the graph"
        h[mask] = fill
        (h.float() ** 2).sum().backward()
        return h, x.grad, w.grad, b.grad

    expected = step(fn, x, w, b)
    torch._dynamo.reset()
    with fusion_compiler.capture_compiles() as reports:     # backward compiles on first use
        got = step(torch.compile(fn, backend="fusion", fullgraph=True), x, w, b)
    forward = [r for r in reports if r.kind == "forward"]
    assert kernel_count(forward) == kernels
    assert sum(r.inplace for r in forward) == inplace
    for name, a, e in zip(("h", "x.grad", "w.grad", "b.grad"), got, expected):
        if e is None:       # the matmul has no bias
            assert a is None, name
            continue
        assert_close(a, e, dtype=dtype, atol=0.05 if dtype != torch.float32 else None,
                     rtol=0.02 if dtype != torch.float32 else None, name=name)


@pytest.mark.parametrize("fn, kernels", [(_projection, 1), (_matmul, 0)],
                         ids=["written-over", "matmul"])
def test_inference_outputs_are_no_views(fn, kernels, device):
    x, w, b = (randn((3, 13, 24), torch.float32, device), randn((40, 24), torch.float32, device),
               randn((40,), torch.float32, device))
    with torch.no_grad():
        out, reports = compile_and_run(fn, (x, w, b))
    assert kernel_count(reports) == kernels
    assert out._base is None
    assert_close(out, fn(x, w, b), dtype=torch.float32)
