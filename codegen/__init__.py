"""Kernel IR, lowering, Triton rendering and the kernel cache (installed as fusion_compiler.codegen)."""
