"""The anchor patterns live in the package (fusion_compiler.patterns) so `bench` can run them."""
from fusion_compiler.patterns import *  # noqa: F401,F403
from fusion_compiler.patterns import PATTERNS, make_args, randn  # noqa: F401
