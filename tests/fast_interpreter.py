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


# the shipped bodies the shape-type memo replaces (Triton 3.9's), line by line without comments,
# docstrings or indentation: anything else runs as shipped
_BLOCK_TYPE_INIT = [
    "def __init__(self, element_ty: dtype, shape: List):", "self.element_ty = element_ty",
    "assert (isinstance(shape, (list, tuple)))", "self.shape = tuple(_unwrap_shape(shape))",
    "if not self.shape:", "raise TypeError('0d block_type is forbidden')",
    "self.numel = validate_block_shape(self.shape)",
    "self.name = f'<{self.shape}, {self.element_ty}>'"]
_TENSOR_INIT = [
    "def __init__(self, handle, type: dtype):", "super().__init__()", "self.handle = handle",
    "self.shape = type.shape if type.is_block() else ()",
    "self.numel = constexpr(math.prod(self.shape))", "self.type = type",
    "self.dtype = type.scalar", "self.shape = tuple([constexpr(s) for s in self.shape])"]


def _code_lines(fn) -> list[str]:
    import inspect
    out, doc = [], False
    for ln in inspect.getsource(fn).splitlines():
        ln = ln.split(" #")[0].strip() if not ln.strip().startswith("#") else ""
        if ln.startswith('"""'):
            doc = not (doc or (ln.count('"""') == 2))
            continue
        if doc:
            doc = '"""' not in ln
            continue
        if ln:
            out.append(ln)
    return out


def memoize_shape_types() -> bool:
    """Every tl tensor the interpreter makes (each operation's result, hundreds of thousands per
    kernel launch) builds its block type and its shape as tl.tuple objects whose tuple_type is
    derived value by value (constexpr_type of each dimension, isinstance checks), and its block
    type validates the shape again: a third of the prefill interpreter tests' CPU time. Derive
    them once per shape: a block type whose shape (plain ints) was built and validated before
    takes that shape's numel and tuple_type; a tensor of such a block type takes the tuple_type
    of its constexpr shape. The objects are as shipped (fresh tl.tuple values lists, fresh
    constexprs, equal types: tuple_type is replaced, never changed in place, by tl.tuple's
    _setitem); a new shape, any other shape form and every error take the shipped path.
    Installed only where both constructors have the known form (Triton 3.9's). -> installed?"""
    if os.environ.get("DSV4_TEST_FAST_INTERPRETER", "1") == "0":
        return False
    try:
        import triton.language.core as core
        block_src, tensor_src = _code_lines(core.block_type.__init__), \
            _code_lines(core.tensor.__init__)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    if getattr(core, "_dsv4_shape_memo", False):
        return True
    if block_src != _BLOCK_TYPE_INIT or tensor_src != _TENSOR_INIT:
        return False
    shipped_block, shipped_tensor = core.block_type.__init__, core.tensor.__init__
    tl_tuple, constexpr, tensor_cls = core.tuple, core.constexpr, core.tensor
    shapes: dict = {}      # shape (ints) -> (numel, the block shape's tuple_type, the tensor's)

    def ints(shape):
        """shape's dimensions as a builtins tuple when each is a plain int (or a constexpr of
        one) in a list or tl.tuple, the forms the shipped code unwraps; else None."""
        t = type(shape)
        vals = shape if t is list else shape.values if t is tl_tuple else None
        if vals is None:
            return None
        out = []
        for d in vals:
            if type(d) is constexpr:
                d = d.value
            if type(d) is not int:
                return None
            out.append(d)
        return tuple(out)

    def block_type_init(self, element_ty, shape):
        key = ints(shape)
        hit = shapes.get(key) if key is not None else None
        if hit is None:
            shipped_block(self, element_ty, shape)
            if key is not None and type(self.numel) is int:       # built and validated
                shapes[key] = [self.numel, self.shape.type, None]
            return
        self.element_ty = element_ty
        self.shape = tl_tuple(list(key), hit[1])
        self.numel = hit[0]
        self.name = f'<{self.shape}, {self.element_ty}>'

    def tensor_init(self, handle, type):
        shape = type.shape if type.is_block() else None
        key = ints(shape) if shape is not None else None
        hit = shapes.get(key) if key is not None else None
        if hit is None or hit[2] is None:
            shipped_tensor(self, handle, type)
            if hit is not None:
                hit[2] = self.shape.type
            return
        super(tensor_cls, self).__init__()
        self.handle = handle
        self.numel = constexpr(hit[0])
        self.type = type
        self.dtype = type.scalar
        self.shape = tl_tuple([constexpr(s) for s in key], hit[2])

    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init
    core._dsv4_shape_memo = True
    return True


def install() -> list[str]:
    """Every speed-up that fits this interpreter -> the names of those installed."""
    return [f.__name__ for f in (skip_nested_interpreter_patching, skip_discarded_overflow_checks,
                                 cache_np_dtypes, memoize_shape_types) if f()]
