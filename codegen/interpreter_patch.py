"""Triton's interpreter, without its repeated patching of ``triton.language`` in nested calls.

Under TRITON_INTERPRET=1 a kernel's launch patches ``triton.language`` (its builtins made to run
on numpy) for the kernel's run, and restores it after. Triton 3.9's interpreter also patches it
again at every call of one ``@triton.jit`` function from another, ``fl.round_bf16(x)`` in a
generated kernel, once per program: ~2 ms each (``inspect.getmembers`` over the language's
modules), which changes nothing, the builtins being patched already: a quarter to a third of
the time of the tests' kernels. ``skip_nested_patching`` makes those nested calls skip it while
the launch's patching (or an earlier nested call's, which Triton never restores) covers the
modules of the language the called function sees; anything else (no launch running, a module
not patched yet) is patched as before. Only work that repeats what is in place is skipped.

``cache_dtype_lookup`` keeps the numpy dtype of each Triton type the interpreter looks up: its
``_get_np_dtype`` builds a table of nineteen types for every lookup, 30 us, once or more for
each op of each program (7% of a split-row test's time in the interpreter).
"""
_original = None       # Triton's own _patch_lang, once installed


def cache_dtype_lookup() -> bool:
    """Install a cache in front of the interpreter's ``_get_np_dtype`` (once); False where this
    Triton has none (then nothing is changed). A block's dtype is its elements'."""
    try:
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:     # pragma: no cover
        return False
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return False
    if getattr(original, "fc_cached", False):
        return True
    cache = {}

    def lookup(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return cache[key]
        except KeyError:
            found = cache[key] = original(tt_dtype)
            return found
        except TypeError:   # pragma: no cover - an unhashable type: as before
            return original(tt_dtype)
    lookup.fc_cached, lookup.fc_original = True, original
    interpreter._get_np_dtype = lookup
    return True


def skip_nested_patching() -> bool:
    """Install the skip into Triton's interpreter (once); False where this Triton's interpreter
    has not the shape it was written for (then nothing is changed)."""
    global _original
    if _original is not None:
        return True
    try:
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:     # pragma: no cover
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:
        return False
    languages = (tl, tl.core)
    seen = {}           # jit function -> the ids of the language modules its globals hold
    running = []        # while a launch runs: the ids of the modules its patching covers

    def patch_lang(fn):
        needed = seen.get(fn)
        if needed is None:
            needed = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                          if any(v is m for m in languages))
        if running:     # a nested call, inside a launch (launches do not nest)
            if needed <= running[0]:
                return scope_type()     # nothing to patch, nothing to restore
            # Triton's nested patching is never restored: what it patched stays patched for
            # the rest of the launch (tl.core, first seen in tl.sum's module, for ever after)
            running[0] = running[0] | needed
            return _original(fn)
        scope = _original(fn)
        running.append(needed)
        restore = scope.restore

        def restore_and_end():
            running.clear()
            restore()
        scope.restore = restore_and_end
        return scope

    _original = original
    interpreter._patch_lang = patch_lang
    return True


def bool_results() -> bool:
    """Make the interpreter's binary ops whose results are numpy booleans (comparisons, ands of
    masks) carry Triton's ``int1`` (once); False where this Triton's interpreter has no
    ``binary_op`` to wrap. Triton 3.9's interpreter types ``x < 3`` as x's dtype (int64)
    around boolean data; broadcasting such a scalar to a block (``mask & (x < 3)``, x a loaded
    scalar) then makes int64 data of it, the and int32, and a load refuses the mask ("mask has
    unsupported dtype"), where the GPU computes an i1. The fuzzer's find (a gather by a
    one-element constant index, in a multi-part kernel)."""
    try:
        import numpy as np
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:     # pragma: no cover
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    original = getattr(builder, "binary_op", None)
    if original is None or handle is None:
        return False
    if getattr(original, "fc_bool", False):
        return True

    def binary_op(self, lhs, rhs, op):
        out = original(self, lhs, rhs, op)
        if out.data.dtype == np.bool_ and out.dtype != tl.int1:
            return handle(out.data, tl.int1)
        return out
    binary_op.fc_bool, binary_op.fc_original = True, original
    builder.binary_op = binary_op
    return True


def live_asserts() -> bool:
    """Make the interpreter test ``tl.device_assert`` as a GPU kernel compiled with ``debug``
    does (once); False where this Triton's interpreter has no options to set. Its builder's
    options keep ``debug`` off whatever the kernel asks, so a gather's index check never ran
    on the CPU: a gather by an index computed from the kernel's index (an arange), unmasked,
    failed on the GPU only (the lanes past the tensor's end hold indices past it)."""
    import dataclasses

    try:
        from triton.runtime import interpreter
    except ImportError:     # pragma: no cover
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not dataclasses.is_dataclass(options) \
            or not hasattr(options, "debug"):
        return False
    if not options.debug:
        # the asserts alone, as the GPU's launches ask (launcher.py): not debug's checks of
        # every integer op for overflow (an int8 add wraps, as in eager)
        extra = {"sanitize_overflow": False} if hasattr(options, "sanitize_overflow") else {}
        builder.options = dataclasses.replace(options, debug=True, **extra)
    return True
