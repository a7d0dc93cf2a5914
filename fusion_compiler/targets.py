"""TARGET, as `fusion-compiler dump` and `bench` take it: a factory returning ``(model,
example_inputs)``, named ``path/to/file.py`` (its ``make_model_and_inputs``), ``path.py:factory``
or ``package.module:factory``; loaded and called with the options it takes. Every problem is a
``DumpError`` whose message says what to fix.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

DEFAULT_FACTORY = "make_model_and_inputs"
USAGE_HINT = "TARGET is path/to/file.py, path.py:factory or package.module:factory"


class DumpError(Exception):
    """A problem the user can fix; ``str(self)`` is the one line that says what and how."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def target_imports():
    """Let the target import what lies next to it, as ``python file.py`` or ``-m`` would; undo
    it afterwards (sys.path and the module registered for a file target)."""
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name.startswith("_fusion_compiler_target"):
                del sys.modules[name]


def load_factory(target: str):
    """(factory, where) for TARGET; ``where`` names it for messages, e.g. 'llama.py:make'."""
    spec, sep, name = target.rpartition(":")
    if not sep:
        spec, name = target, DEFAULT_FACTORY
    if not spec or not name:
        raise DumpError(f"TARGET {target!r} is incomplete; {USAGE_HINT}")
    is_file = spec.endswith(".py") or "/" in spec or os.sep in spec or os.path.isfile(spec)
    module = _load_file(spec) if is_file else _import_module(spec)
    where = f"{spec}:{name}"
    factory = getattr(module, name, None)
    if factory is None:
        defined = [k for k, v in vars(module).items()
                   if inspect.isfunction(v) and v.__module__ == module.__name__]
        there = f" (functions there: {', '.join(defined[:6])})" if defined else ""
        what = (f"define {DEFAULT_FACTORY}(device, dtype) returning (model, example_inputs), "
                f"or name the factory as {spec}:FACTORY" if not sep else "check the name")
        raise DumpError(f"{spec} has no {name!r}{there}; {what}")
    if not callable(factory):
        raise DumpError(f"{where} is a {type(factory).__name__}, not a function; name a factory "
                        "that returns (model, example_inputs)")
    return factory, where


def _load_file(path: str):
    p = Path(path)
    if not p.exists():
        raise DumpError(f"no such file: {path}; {USAGE_HINT}")
    if not p.is_file() or p.suffix != ".py":
        raise DumpError(f"{path} is not a Python file; {USAGE_HINT}")
    sys.path.insert(0, str(p.resolve().parent))        # its sibling modules import
    name = "_fusion_compiler_target_" + "".join(c if c.isalnum() else "_" for c in p.stem)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, p))
    sys.modules[name] = module                          # dataclasses and pickle look it up
    try:
        module.__spec__.loader.exec_module(module)
    except Exception as exc:
        raise DumpError(f"running {path} failed: {describe(exc)}; fix the file "
                        "(--debug shows the traceback)") from exc
    return module


def _import_module(name: str):
    if not all(part.isidentifier() for part in name.split(".")):
        raise DumpError(f"{name!r} is neither a .py file nor a module name; {USAGE_HINT}")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise DumpError(f"no module named {exc.name!r}; run from the folder that holds it, "
                            "set PYTHONPATH, or give a path/to/file.py") from exc
        raise DumpError(f"importing {name} failed: {describe(exc)}") from exc
    except Exception as exc:
        raise DumpError(f"importing {name} failed: {describe(exc)}; fix the module "
                        "(--debug shows the traceback)") from exc


def call_factory(factory, where: str, device: str, dtype):
    """(model, inputs tuple, kwargs given): call the factory with the options it takes."""
    import torch

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def takes(name):
        return takes_all or name in params and params[name].kind is not params[name].POSITIONAL_ONLY

    kwargs = {"device": device} if takes("device") else {}
    if dtype is not None:
        if not takes("dtype"):
            raise DumpError(f"--dtype {dtype}: {where} takes no dtype argument; drop --dtype or "
                            "add a dtype parameter to the factory")
        kwargs["dtype"] = getattr(torch, dtype)
    if params:
        try:
            inspect.signature(factory).bind(**kwargs)
        except TypeError as exc:
            raise DumpError(f"cannot call {where}({', '.join(kwargs)}): {exc}; give its other "
                            "parameters defaults") from None
    try:
        result = factory(**kwargs)
    except Exception as exc:
        raise DumpError(f"{where} raised {describe(exc)} (--debug shows the traceback)") from exc
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = type(result).__name__
        got += f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""
        raise DumpError(f"{where} returned a value of type {got}; it must return "
                        "(model, example_inputs)")
    model, inputs = result
    if not callable(model):
        raise DumpError(f"{where} returned a {type(model).__name__} as the model; it must be an "
                        "nn.Module or a function")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise DumpError(f"{where} returned {type(inputs).__name__} as example_inputs; give a "
                        "tuple or list of inputs (or one tensor)")
    return model, tuple(inputs), {k: str(v).replace("torch.", "") for k, v in kwargs.items()}


def describe(exc: BaseException) -> str:
    """'ValueError: first line of the message', at most 300 characters."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
