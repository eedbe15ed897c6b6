"""A pytest plugin for ``test_kernels_compile.py``: records every Triton kernel launch that the interpreter
runs (which kernel, its arguments' types, its compile-time constants) and writes the distinct ones as JSON
to the file named by ``KERNEL_LAUNCHES`` when the session ends.

    TRITON_INTERPRET=1 KERNEL_LAUNCHES=launches.json python -m pytest -p tests.kernels.launch_capture tests/kernels
"""

import json
import os

import torch
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}
seen: dict[str, dict] = {}


def type_of(value) -> str:
    """Triton's name for an argument's type, as a GPU launch would see it."""
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"an argument of type {type(value).__name__} this plugin does not name")


params_of: dict = {}


def record(fn, args, kwargs) -> None:
    if fn not in params_of:
        params_of[fn] = JITFunction(fn).params
    params = params_of[fn]
    values = dict(zip([p.name for p in params], args)) | {k: v for k, v in kwargs.items()
                                                          if k in {p.name for p in params}}
    signature, constants = {}, {}
    for p in params:
        if p.name not in values:                        # an argument with a default, not passed
            continue
        value = values[p.name]
        if p.is_constexpr or value is None:
            constants[p.name] = value if not hasattr(value, "value") else value.value
        else:
            signature[p.name] = type_of(value)
    entry = {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constants": constants}
    seen.setdefault(json.dumps(entry, sort_keys=True), entry)


_run = interpreter.InterpretedFunction.run


def run(self, *args, grid, warmup, **kwargs):
    record(self.fn, args, kwargs)
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


interpreter.InterpretedFunction.run = run


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["KERNEL_LAUNCHES"], "w") as f:
        json.dump(list(seen.values()), f, indent=1)
