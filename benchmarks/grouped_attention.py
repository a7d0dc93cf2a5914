"""Does attention take grouped key/value heads as fast as repeated ones? (GPU; the evidence
behind passes/grouped_attention.py)

    python benchmarks/grouped_attention.py

At the Llama example's attention shapes (16 query heads, 4 key/value heads, head size 128;
4 x 1024 and 1 x 128 tokens, bf16, causal): SDPA on repeat_kv's copies (what the example does)
against SDPA with ``enable_gqa=True`` on the grouped heads, with the ATen ops each traces to
(make_fx) and do_bench times; then each fused backend forced (``sdpa_kernel``) on both, with its
largest difference from the first. Session 40 (H200, torch 2.11): both trace to cuDNN's
attention, 51.6-52.0 us on the grouped heads against 52.0 on the copies, bit-equal; Flash takes
grouped heads too (94.0 us, 96.0 on copies); the memory-efficient kernel does not.
"""
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

torch.manual_seed(0)
for B, S in ((4, 1024), (1, 128)):
    H, KV, D = 16, 4, 128
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16)
    def rep(x):
        b, n, s, d = x.shape
        return x[:, :, None].expand(b, n, H // n, s, d).reshape(b, H, s, d)
    ke, ve = rep(k), rep(v)
    def expanded(q, k, v):
        return F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=True)
    def gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = expanded(q, k, v)
    for name, fn in (("expanded", expanded), ("gqa", gqa)):
        g = make_fx(fn)(q, k, v)
        ops = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
        out = fn(q, k, v)
        err = (out.float() - ref.float()).abs().max().item()
        ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=200)
        print(f"B={B} S={S} {name:9s} {ms*1e3:8.1f} us  err {err:.3g}  ops {ops}", flush=True)
    def on_copies():
        return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    ms = do_bench(on_copies, warmup=25, rep=200)
    print(f"B={B} S={S} sdpa on pre-expanded k/v {ms * 1e3:8.1f} us")
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION):
        for name, fn in (("expanded", on_copies), ("gqa", lambda: gqa(q, k, v))):
            try:
                with sdpa_kernel([be]):
                    out = fn()
                    ms = do_bench(fn, warmup=25, rep=200)
                err = (out.float() - ref.float()).abs().max().item()
                print(f"B={B} S={S} {be.name:20s} {name:9s} {ms * 1e3:8.1f} us err {err:.3g}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a backend that refuses is reported
                print(f"B={B} S={S} {be.name:20s} {name:9s} failed: {str(e)[:150]}", flush=True)
