"""tests/fast_interpreter.py's shape-type memo builds the objects Triton's constructors build."""
import subprocess
import sys

import pytest

from conftest import REPO, needs_interpreter

# in a process of its own: the memo patches triton.language.core for the whole process
CHECK = r'''
import itertools
import triton.language as tl
import triton.language.core as core
shipped_block, shipped_tensor = core.block_type.__init__, core.tensor.__init__
import fast_interpreter
assert fast_interpreter.memoize_shape_types(), "not installed on this Triton"
memo_block, memo_tensor = core.block_type.__init__, core.tensor.__init__
assert (memo_block, memo_tensor) != (shipped_block, shipped_tensor)
C = core.constexpr


def build(init, cls, *args):
    obj = cls.__new__(cls)
    try:
        init(obj, *args)
        return obj, None
    except Exception as e:          # the same exception, type and text
        return None, (type(e), str(e))


def of_block(b):
    return (b.element_ty, type(b.shape), b.shape.values, b.shape.type, b.shape.type.name,
            b.numel, b.name, str(b), [type(v) for v in b.shape.values])


def of_tensor(t):
    return (t.handle, type(t.shape), t.shape.values, t.shape.type, t.shape.type.name,
            type(t.numel), t.numel.value, t.numel.type, t.type, t.dtype,
            [(type(v), v.type) for v in t.shape.values])


dtypes = [tl.float32, tl.int32, tl.bfloat16, tl.int1, tl.pointer_type(tl.float32)]
shapes = [[16], [1, 32], [4, 8, 2], [C(16), 8], [C(4), C(2)], [3], [0], [], [True], [16.0],
          [C([2]), 4], [2 ** 21, 2 ** 4], core.tuple([16]), core.tuple([2, 4]),
          core.tuple([C(8), 1])]
n = 0
for _ in range(3):                  # the first round fills the memo, the others read it
    for dt, shape in itertools.product(dtypes, shapes):
        (a, ea), (b, eb) = (build(i, core.block_type, dt, shape) for i in (shipped_block, memo_block))
        assert ea == eb, (shape, ea, eb)
        if a is None:
            continue
        assert of_block(a) == of_block(b), (of_block(a), of_block(b))
        assert a.shape.values is not b.shape.values
        for ty in (a, dt):
            (x, ex), (y, ey) = (build(i, core.tensor, "handle", ty)
                                for i in (shipped_tensor, memo_tensor))
            assert ex == ey and (x is None) == (y is None), (ty, ex, ey)
            assert x is None or of_tensor(x) == of_tensor(y), (of_tensor(x), of_tensor(y))
            n += 1
assert n > 100, n
print("ok")
'''


@needs_interpreter
def test_shape_type_memo_builds_what_triton_builds():
    """Block types and tensors of valid and invalid shapes (plain ints, constexprs, tl.tuple,
    0, empty, bool, float, a list inside, too many elements), each dtype, built by the shipped
    constructors and by the memo's, before and after the memo holds the shape: equal attributes
    and types, or the same exception."""
    import os
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"), DSV4_TEST_FAST_INTERPRETER="1")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                       timeout=300)
    if p.returncode and "not installed on this Triton" in p.stderr:
        pytest.skip("the memo does not install on this Triton (its constructors differ)")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-4000:]
