"""Graph passes on ATen FX graphs (installed as fusion_compiler.passes)."""
