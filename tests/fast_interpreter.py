"""Speed-ups of Triton's interpreter for the kernel tests' subprocesses (TRITON_INTERPRET=1):
work the interpreter does and then discards, skipped, the kernels' results unchanged. Each is
installed only on an interpreter of the known form; DSV4_TEST_FAST_INTERPRETER=0 turns all off."""
from __future__ import annotations

import os


def skip_nested_interpreter_patching() -> bool:
    """Triton's interpreter re-patches triton.language (an inspect.getmembers over the module, its
    tensor class and tl.math) on every call of a nested @triton.jit function, though the launch
    has already patched those modules and the re-patch changes nothing: over half of the
    interpreter tests' time (hc_pre_norm_rows of 70 rows: 16 s, 7 s without it). Skip a nested
    call's re-patch when every language module it sees is already patched by the running launch
    (any other still patches, as Triton does). Installed only on an interpreter of the known
    form (Triton 3.9's: _patch_lang returns a _LangPatchScope that the launch restores); anything
    else runs as shipped. DSV4_TEST_FAST_INTERPRETER=0 turns it off. -> installed?"""
    if os.environ.get("DSV4_TEST_FAST_INTERPRETER", "1") == "0":
        return False
    import inspect
    try:
        import triton.language as tl
        import triton.runtime.interpreter as interp
        grid_src = inspect.getsource(interp.GridExecutor.__call__)
        nested_src = inspect.getsource(interp.InterpretedFunction.__call__)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    if getattr(interp, "_dsv4_nested_patch_skip", False):
        return True
    if not (hasattr(interp, "_LangPatchScope") and callable(getattr(interp, "_patch_lang", None))
            and "patch_scope = _patch_lang(self.fn)" in grid_src
            and "patch_scope.restore()" in grid_src and "_patch_lang(self.fn)" in nested_src):
        return False
    patch_lang, grid_call = interp._patch_lang, interp.GridExecutor.__call__
    # per running launch (innermost last): [its function, the ids of the language modules
    # patched since its own _patch_lang; None before that]
    running: list = []

    def langs(fn) -> frozenset:
        # read afresh each call, as Triton does: rewriting a function adds the interpreter's
        # globals (its `tl`) to its module's globals, so they can gain a language module. The
        # ids of the language modules among the globals' values (a module compares by identity),
        # the scan in C: called on every nested call, a Python loop over the globals took 7 %
        present = set(map(id, list(fn.__globals__.values())))
        return frozenset(i for i in (id(tl), id(tl.core)) if i in present)

    def _patch_lang(fn):
        seen = langs(fn)
        if running and running[-1][1] is not None and seen and seen <= running[-1][1]:
            return interp._LangPatchScope()         # nothing to patch, nothing to restore
        scope = patch_lang(fn)   # (no language module in sight: Triton's own assertion)
        if running and (running[-1][1] is not None or fn is running[-1][0]):
            running[-1][1] = (running[-1][1] or frozenset()) | seen
        return scope

    def __call__(self, *args, **kwargs):
        running.append([self.fn, None])     # recorded from the launch's own _patch_lang on
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            running.pop()

    interp._patch_lang = _patch_lang
    interp.GridExecutor.__call__ = __call__
    interp._dsv4_nested_patch_skip = True
    return True


def skip_discarded_overflow_checks() -> bool:
    """Triton's semantic layer builds an integer-overflow check for every tl add / sub / mul of
    32-bit (or narrower) integers (both operands cast to int64, the operation again, two compares
    and an and) and hands it to device_assert, which drops it unless the builder's options say
    debug; the interpreter's never do (InterpreterOptions(), debug=False, set nowhere), so the
    check's tensors are computed and thrown away: a quarter of the interpreter tests' CPU time
    (prefill layer 3: 112 s, 85 s without). Skip the building where device_assert would drop it
    (the operand type assertions still run, as shipped); with debug on it runs as shipped.
    Installed only where both functions have the known form (Triton 3.9's). -> installed?"""
    if os.environ.get("DSV4_TEST_FAST_INTERPRETER", "1") == "0":
        return False
    import inspect
    try:
        from triton.language.semantic import TritonSemantic
        check_src = inspect.getsource(TritonSemantic.binary_op_sanitize_overflow_impl)
        assert_src = inspect.getsource(TritonSemantic.device_assert)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    if getattr(TritonSemantic, "_dsv4_overflow_skip", False):
        return True
    # the check's one effect is device_assert(cond, msg, None), whose first statement returns
    # unless options.debug
    body = [ln.strip() for ln in assert_src.splitlines()[1:] if ln.strip()]
    if not (body[:2] == ["if not self.builder.options.debug:", "return"]
            and check_src.count("self.device_assert(") == 1
            and "self.device_assert(cond, msg, None)" in check_src
            and check_src.count("return") == 1):
        return False
    shipped = TritonSemantic.binary_op_sanitize_overflow_impl

    def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
        if self.builder.options.debug:
            return shipped(self, lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth >= 64 or not self.builder.options.sanitize_overflow:
            return
        lhs_sca_ty, rhs_sca_ty = lhs.type.scalar, rhs.type.scalar
        assert lhs_sca_ty == rhs_sca_ty, \
            f"expected matching operand types, got {lhs_sca_ty} and {rhs_sca_ty}"
        assert lhs_sca_ty.is_int(), f"expected integer type, got {lhs_sca_ty}"

    TritonSemantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl
    TritonSemantic._dsv4_overflow_skip = True
    return True


def cache_np_dtypes() -> bool:
    """The interpreter's _get_np_dtype (the NumPy dtype holding a Triton dtype's values, asked
    for on most operations) builds its table of 19 Triton dtypes, each hashed, on every call: 8 %
    of the interpreter tests' CPU time. Memoize it per scalar Triton dtype (which compare and hash
    by name): a block type's answer is its element type's, a pointer's uint64, as shipped.
    Installed only where it has the known form (Triton 3.9's). -> installed?"""
    if os.environ.get("DSV4_TEST_FAST_INTERPRETER", "1") == "0":
        return False
    import inspect
    try:
        import triton.runtime.interpreter as interp
        src = inspect.getsource(interp._get_np_dtype)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    if getattr(interp, "_dsv4_np_dtype_cache", False):
        return True
    # the known form: a table built in the body, read with the dtype or its element type; no
    # global but the module's own tl / np
    code = interp._get_np_dtype.__code__
    if not ("np_types = {" in src and "return np_types[tt_dtype]" in src
            and set(code.co_names) <= {"isinstance", "tl", "np", "pointer_type", "dtype", "uint64",
                                       "block_type", "element_ty", "int1", "float16", "float32",
                                       "float64", "int8", "uint8", "int16", "uint16", "int32",
                                       "uint32", "int64", "bool", "bfloat16", "float8e5",
                                       "float8e5b16", "float8e4nv", "float8e4b8",
                                       "float8e4b15"}):
        return False
    shipped, memo, tl = interp._get_np_dtype, {}, interp.tl

    def _get_np_dtype(tt_dtype):
        # shipped: a pointer (or a block of them) -> uint64; a block -> its element type's
        # entry; else the table's. Scalar dtypes (hashable, by name) are the memo's keys
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return shipped(tt_dtype)
        try:
            return memo[key]
        except KeyError:
            pass
        memo[key] = np_dtype = shipped(key)      # raises as shipped for an unknown one
        return np_dtype

    interp._get_np_dtype = _get_np_dtype
    interp._dsv4_np_dtype_cache = True
    return True


def install() -> list[str]:
    """Every speed-up that fits this interpreter -> the names of those installed."""
    return [f.__name__ for f in (skip_nested_interpreter_patching, skip_discarded_overflow_checks,
                                 cache_np_dtypes) if f()]
