"""Host time per node of fusion's compiled inference graph (GPU; Llama 1 x 128 by default).

    python benchmarks/host_per_node.py [TARGET]      (TARGET as for `dump`)

Prints the whole call's time, the number of call nodes in the compiled graph, the host time
of each kind of node (median over 25 runs of an FX interpreter that times each call; the
interpreter's own overhead inflates these), single-op host costs for comparison, and the host
and GPU time of each SDPA backend at 1 x 128 and 4 x 1024.
"""
import argparse
import collections
import statistics
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from fusion_compiler import backend as B
from fusion_compiler.targets import load_factory


def per_call(fn, n=100):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target", nargs="?", default="examples/llama.py:bench_1x128")
    target = ap.parse_args().target
    captured = {}
    compile_aten_graph = B.compile_aten_graph

    def spy(gm, kind, config, **kwargs):
        new = compile_aten_graph(gm, kind, config, **kwargs)
        captured["gm"] = new
        forward = new.forward           # takes the inputs as one list, which it empties

        def call(args):
            captured.setdefault("args", list(args))
            return forward(args)
        new.forward = call
        return new
    B.compile_aten_graph = spy
    model, inputs = load_factory(target)[0](device="cuda", dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():
        f = torch.compile(model, backend="fusion")
        f(*inputs)
        gm, args = captured["gm"], captured["args"]
        forward = type(gm).forward.__get__(gm)
        print(f"{target}: full compiled call {per_call(lambda: f(*inputs)):.0f} us; graph module "
              f"alone {per_call(lambda: forward(list(args))):.0f} us; "
              f"eager {per_call(lambda: model(*inputs)):.0f} us")
        times = collections.defaultdict(list)

        class Timed(torch.fx.Interpreter):
            def run_node(self, n):
                if n.op != "call_function":
                    return super().run_node(n)
                a, k = self.fetch_args_kwargs_from_env(n)
                t = time.perf_counter()
                r = n.target(*a, **k)
                times[n].append(time.perf_counter() - t)
                return r
        interp = Timed(gm)
        for _ in range(30):
            interp.run(*args)
        torch.cuda.synchronize()
        kinds = collections.defaultdict(lambda: [0, 0.0])
        for n, ts in times.items():
            if n.meta.get("fc_launcher") is not None:
                key = "launcher " + Path(n.target.func.__code__.co_filename).stem[:6]
            else:
                key = getattr(n.target, "__name__", str(n.target))
            kinds[key][0] += 1
            kinds[key][1] += statistics.median(ts[5:]) * 1e6
        print(f"sum of node host medians {sum(v[1] for v in kinds.values()):.0f} us over "
              f"{sum(v[0] for v in kinds.values())} call nodes")
        for k, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"{k:40s} {c:4d} calls {t:8.1f} us  {t / c:6.2f} us/call")
        x = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(128, 2048, device="cuda", dtype=torch.bfloat16)
        empty = torch._C._dynamo.guards._empty_strided_cuda
        reinterpret = torch._C._dynamo.guards._reinterpret_tensor
        v = x.view(1, 128, 16, 128)
        for name, fn in [("view+permute", lambda: x.view(1, 128, 16, 128).permute(0, 2, 1, 3)),
                         ("torch.as_strided", lambda: torch.as_strided(
                             x, (1, 16, 128, 128), (262144, 128, 2048, 1), 0)),
                         ("aten.as_strided.default", lambda: torch.ops.aten.as_strided.default(
                             x, (1, 16, 128, 128), (262144, 128, 2048, 1), 0)),
                         ("_reinterpret_tensor", lambda: reinterpret(
                             x, (1, 16, 128, 128), (262144, 128, 2048, 1), 0)),
                         ("permute of a view", lambda: v.permute(0, 2, 1, 3)),
                         ("torch.mm", lambda: torch.mm(x, w)),
                         ("torch.mm out=", lambda: torch.mm(x, w, out=out)),
                         ("aten.mm.default", lambda: torch.ops.aten.mm.default(x, w)),
                         ("x.view", lambda: x.view(1, 128, 2048)),
                         ("torch.add", lambda: torch.add(x, x)),
                         ("empty_strided_cuda",
                          lambda: empty((128, 2048), (2048, 1), torch.bfloat16))]:
            print(f"{name:30s} {per_call(fn, 2000):6.2f} us")
        for b, s in [(1, 128), (4, 1024)]:
            q, k, v = (torch.randn(b, 16, s, 128, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            aten = torch.ops.aten
            ops = {"cudnn": lambda: aten._scaled_dot_product_cudnn_attention(
                       q, k, v, None, False, 0.0, True, False),
                   "flash": lambda: aten._scaled_dot_product_flash_attention(
                       q, k, v, 0.0, True, False),
                   "efficient": lambda: aten._scaled_dot_product_efficient_attention(
                       q, k, v, None, False, 0.0, True),
                   "F.sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                       q, k, v, is_causal=True)}
            for name, op in ops.items():
                for _ in range(20):
                    op()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(200):
                    op()
                host = (time.perf_counter() - t) / 200 * 1e6
                torch.cuda.synchronize()
                print(f"sdpa {b}x{s} {name:10s} host {host:6.1f} us  "
                      f"gpu {do_bench(op, warmup=10, rep=100) * 1e3:7.1f} us")


if __name__ == "__main__":
    main()
