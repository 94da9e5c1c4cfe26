"""The engine versions `make engines` was verified with, and the fixes that let fla's kernels run on a CPU.

    python bench/engines/pins.py vllm     # the pip requirements of a venv (the Makefile installs them)

Each venv installs torch first (the CPU build on disk: TORCH), then REQUIREMENTS[venv]. The vLLM venv's pins are
the library's (dflash/data/vllm_runtime/vllm_pins.py: features.source=vllm runs there, and checks them itself),
read here by path; the fla venv's are below. Every check starts with `check(venv)`, which stops, naming the
package, the pin and what it found, when an installed version is not the pinned one: a moved version is
re-verified (these fixes and the checks' findings are version-specific), then pinned. This file imports nothing
but the standard library at the top, so that a bare python3 prints the requirements and vllm_serve.py imports it
in the vLLM venv.

`apply_interpreter_fixes()` (the fla venv, with TRITON_INTERPRET=1, before any kernel runs or transformers'
Qwen3.5 module is imported) patches Triton and transformers in memory, nothing on disk. Under Triton's
interpreter, fla's `fused_recurrent_gated_delta_rule` runs as shipped, but `chunk_gated_delta_rule` (what
transformers' Qwen3.5 Gated DeltaNet layers call on a prompt) meets three interpreter defects, and transformers
would not call fla on a CPU at all:

1. Autotuning: ``Autotuner.run`` benchmarks several configs through a GPU driver and, with none, fails
   with "0 active drivers". ``Autotuner.prune_configs`` now keeps only the first config it would keep,
   and ``run`` takes a single pruned config without benchmarking.
2. Range-loop variables: in compiled Triton the variable of ``for i in range(n)`` / ``tl.range(n)`` is a
   tensor; the interpreter gives a Python int, so fla's ``i_t.to(tl.int64)`` raises "'int' object has no
   attribute 'to'". ``FunctionRewriter.ast_transformer`` (the AST pass that already wraps assignments in
   ``interpreter_semantic.to_tensor``) becomes an ``ASTTransformer`` subclass whose ``visit_For`` puts
   ``i = interpreter_semantic.to_tensor(i, False)`` first in such loops; ``tl.static_range`` variables
   stay ints. The cache of rewritten kernels, ``InterpretedFunction.rewritten_fn``, is cleared.
3. bfloat16 arithmetic: the interpreter holds bf16 values as uint16 bit patterns, and ``InterpreterBuilder``
   then computes on the integers: wrong numbers, no error. ``binary_op``, ``unary_op``, ``ternary_op``,
   ``create_fma``, ``create_dot`` and the numpy paths of ``ReduceOps.sum``/``min_max`` and
   ``ScanOps.cumsum``/``cumprod`` now widen bf16 operands to float32 and round a bf16-typed result back
   (comparisons give int1; bf16 sums and scans accumulate in float32 and round once). ``cast_impl`` went
   through the integers for bf16 <-> int and truncated float32 -> bf16; it now rounds to nearest even, as
   ``.to(tl.bfloat16)`` does on a GPU and in torch. The bit conversions are our own (shift up, rounding
   add down): the interpreter's ``_convert_float`` maps bf16 subnormals wrongly and its round-to-nearest
   drops the carry out of the mantissa. (Triton rejects bf16 for exp, log, sqrt, erf..., so those are fine.)
4. transformers 5.25 binds fla when it is importable but runs its PyTorch reference for inputs on a device
   outside ``hub_kernels._PACKAGE_SUPPORTED_DEVICES["fla"]`` (cuda, xpu, mlu, npu): "cpu" joins the list.
   Without it the interpreted kernels never run here, and dflash's kernel report rightly says torch_fallback.

Each patched attribute is checked first (present, same parameters): a moved Triton stops loudly rather than
running unpatched.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path


def _library_pins():
    """dflash/data/vllm_runtime/vllm_pins.py, loaded from its file: a bare python3 (the Makefile's, the vLLM
    venv's) has no dflash to import it from."""
    path = Path(__file__).resolve().parents[2] / "dflash" / "data" / "vllm_runtime" / "vllm_pins.py"
    spec = importlib.util.spec_from_file_location("vllm_pins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vllm_pins = _library_pins()
TORCH = vllm_pins.TORCH
VLLM = vllm_pins.VLLM
VLLM_TRANSFORMERS = vllm_pins.VLLM_TRANSFORMERS
TRITON = "3.9.0"
FLA = "0.6.0"
FLA_TRANSFORMERS = "5.25.0"  # whose CPU rule fix 4 lifts
HERE = "bench/engines/pins.py"

REQUIREMENTS = {
    "vllm": vllm_pins.REQUIREMENTS,
    # dflash itself (editable, from the checkout) with the kernels transformers binds for Gated DeltaNet
    "fla": [f"triton=={TRITON}", f"flash-linear-attention=={FLA}", f"transformers=={FLA_TRANSFORMERS}"],
}
PINNED = {"vllm": vllm_pins.PINNED,
          "fla": {"triton": TRITON, "flash-linear-attention": FLA, "transformers": FLA_TRANSFORMERS,
                  "torch": f"{TORCH}+cpu"}}
UNWANTED = {"vllm": vllm_pins.UNWANTED, "fla": []}
WHERE = {"vllm": vllm_pins.HERE, "fla": HERE}


def check(venv: str) -> None:
    """Stop unless this interpreter has exactly the pinned versions of `venv`'s engines, and none of UNWANTED."""
    vllm_pins.check(PINNED[venv], UNWANTED[venv], WHERE[venv])


def _expect(owner, name, params=None):
    return vllm_pins.expect(owner, name, params, where=f"the fixes in {HERE}")


# fix 3's InterpreterBuilder ops: (name, parameters after self, how many lead operands, the operand whose
# type is the result's)
_WIDENED = (("binary_op", ["lhs", "rhs", "op"], 2, 0), ("unary_op", ["arg", "op"], 1, 0),
            ("ternary_op", ["lhs", "rhs", "other", "op"], 3, 2), ("create_fma", ["x", "y", "z"], 3, 2),
            ("create_dot", ["a", "b", "d", "input_precision", "max_num_imprecise_acc"], 3, 2))


def _reductions(itp):
    return ((itp.ReduceOps, "sum", ["input"]), (itp.ScanOps, "cumsum", ["input"]), (itp.ScanOps, "cumprod", ["input"]),
            (itp.ReduceOps, "min_max", ["input", "val_reduce_op", "idx_reduce_op"]))


def _fix_autotune(autotuner):
    orig = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: orig(self, kwargs)[:1]


def _fix_range_loops(itp):
    class _Transformer(itp.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            f = node.iter.func if isinstance(node.iter, ast.Call) else None
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == "range" and isinstance(node.target, ast.Name):  # range or tl.range, not static_range
                var = node.target.id
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                          ctx=ast.Load())
                wrap = ast.Assign(targets=[ast.Name(id=var, ctx=ast.Store())], value=ast.Call(
                    func=to_tensor, args=[ast.Name(id=var, ctx=ast.Load()), ast.Constant(value=False)], keywords=[]))
                node.body.insert(0, ast.copy_location(wrap, node))
            return node

    itp.FunctionRewriter.ast_transformer = _Transformer()
    itp.InterpretedFunction.rewritten_fn.clear()


def _fix_bf16(itp, tl):
    import numpy as np
    B, H, u32 = itp.InterpreterBuilder, itp.TensorHandle, np.uint32

    def is_bf16(h):
        return isinstance(h, H) and h.dtype.scalar == tl.bfloat16 and h.data.dtype == np.uint16

    def f32(h):  # exact: a bf16 is the top half of a float32
        return H((h.data.astype(u32) << u32(16)).view(np.float32), tl.float32) if is_bf16(h) else h

    def bf16(x):  # float32 -> bf16 bits, round to nearest even; a NaN stays a (quiet) NaN
        x = np.asarray(x, dtype=np.float32)
        bits = x.view(u32)
        rounded = (bits + u32(0x7FFF) + ((bits >> u32(16)) & u32(1))) >> u32(16)
        return H(np.where(np.isnan(x), (bits >> u32(16)) | u32(0x40), rounded).astype(np.uint16), tl.bfloat16)

    def back(h):  # the float32 result of an op whose type is bf16
        return H(h.data, tl.int1) if h.data.dtype == np.bool_ else bf16(h.data)

    def widen(orig, n, out):
        def op(self, *args):
            if not any(is_bf16(a) for a in args[:n]):
                return orig(self, *args)
            res = orig(self, *map(f32, args[:n]), *args[n:])
            return back(res) if is_bf16(args[out]) else res
        return op

    def cast_impl(self, src, dst_type):
        if is_bf16(src) and dst_type.scalar != tl.bfloat16:
            return orig_cast(self, f32(src), dst_type)
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar != tl.bfloat16 and not src.dtype.scalar.is_fp8():
            return bf16(orig_cast(self, src, tl.float32).data)
        return orig_cast(self, src, dst_type)

    def on_tensors(orig):  # ReduceOps/ScanOps methods take a tl.tensor and give tensor(s)
        def op(self, input, *args, **kwargs):
            x = input[0] if isinstance(input, tuple) else input
            if not is_bf16(x.handle):
                return orig(self, input, *args, **kwargs)
            res = orig(self, tl.core.tensor(f32(x.handle), x.type.with_element_ty(tl.float32)), *args, **kwargs)
            one = lambda t: (tl.core.tensor(back(t.handle), t.type.with_element_ty(tl.bfloat16))
                             if t.dtype == tl.float32 else t)
            return one(res) if isinstance(res, tl.core.tensor) else type(res)(map(one, res))
        return op

    orig_cast = B.cast_impl
    B.cast_impl = cast_impl
    for name, _, n, out in _WIDENED:
        setattr(B, name, widen(getattr(B, name), n, out))
    for cls, name, _ in _reductions(itp):
        setattr(cls, name, on_tensors(getattr(cls, name)))


def _fix_fla_on_cpu():
    from transformers.integrations import hub_kernels

    if "transformers.models.qwen3_5.modeling_qwen3_5" in sys.modules:
        raise SystemExit("pins: transformers' Qwen3.5 module is already imported; apply the fixes before it is")
    devices = _expect(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES").get("fla")
    if devices is None:
        raise SystemExit("pins: transformers has no _PACKAGE_SUPPORTED_DEVICES['fla']: re-verify fix 4 in "
                         "bench/engines/pins.py")
    if "cpu" not in devices:
        hub_kernels._PACKAGE_SUPPORTED_DEVICES["fla"] = (*devices, "cpu")


def apply_interpreter_fixes() -> None:
    """The four fixes above, once per process (idempotent), after checking the fla venv's pins and that every
    attribute a fix patches is as it was."""
    check("fla")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("pins: TRITON_INTERPRET must be '1', set before triton and fla are imported; it is "
                         f"{os.environ.get('TRITON_INTERPRET')!r}")
    import triton.language as tl
    from triton.runtime import autotuner
    from triton.runtime import interpreter as itp

    if getattr(itp, "_dflash_triton_fixes", False):  # a marker on Triton, so a second copy of this file sees it
        return
    _expect(autotuner.Autotuner, "prune_configs", ["self", "kwargs"])
    _expect(itp.ASTTransformer, "visit_Assign", ["self", "node"])
    if type(_expect(itp.FunctionRewriter, "ast_transformer")) is not itp.ASTTransformer or \
            not isinstance(_expect(itp.InterpretedFunction, "rewritten_fn"), dict):
        raise SystemExit("pins: the interpreter's AST rewriting changed (or is already patched by something else); "
                         "re-verify the fixes in bench/engines/pins.py")
    _expect(itp, "interpreter_semantic"), _expect(itp, "TensorHandle")
    for name, params, _, _ in (*_WIDENED, ("cast_impl", ["src", "dst_type"], 0, 0)):
        _expect(itp.InterpreterBuilder, name, ["self", *params])
    for cls, name, params in _reductions(itp):
        _expect(cls, name, ["self", *params])
    _fix_fla_on_cpu()
    _fix_autotune(autotuner)
    _fix_range_loops(itp)
    _fix_bf16(itp, tl)
    itp._dflash_triton_fixes = True


if __name__ == "__main__":  # `pins.py vllm`: what to install; `pins.py vllm-unwanted`: what to remove after
    venv, _, unwanted = sys.argv[1].partition("-")
    print(" ".join(UNWANTED[venv] if unwanted else REQUIREMENTS[venv]))
