"""The attention-side decode kernels (dsv4/kernels/{attention,compressor,indexer}_decode.py) compile
for sm_90 at the Flash shapes, on any machine (triton ships ptxas): the interpreter accepts code the
compiler rejects. `python -m pytest tests/dsv4/kernels/test_attention_kernels_compile.py`
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from conftest import REPO


def _compile_all():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4.kernels.decode import attention as A
    from dsv4.kernels.decode import attention_prep as AP
    from dsv4.kernels.decode import compressor as C
    from dsv4.kernels.decode import indexer as I
    pl = A.plan_attention(64, 512, 128, 512)
    split = dict(HB=pl["hb"], BN=pl["bn"], BPS=pl["bps"], NSPLIT=pl["nsplit"])
    lp = A.plan_attention(64, 512, 128, 8125)
    assert (lp["hb"], lp["bn"], lp["num_warps"]) == (32, 64, 8), lp
    attn = dict(H=64, DH=512, W=128, R=4, KC=512, MODE=A.MODE_INDEXED, NOPE=448, F32=False)
    comp = "kv_ptr sc_ptr ape_ptr skv_ptr ssc_ptr norm_ptr freqs_ptr"
    jobs = [  # kernel, float32 pointer args (others bf16), constexprs, num_warps
        (AP._rms_norm_kernel, "w_ptr", dict(D=1536, BD=2048), 4),
        (AP._prep_kernel, "kvw_ptr freqs_ptr", dict(H=64, DH=512, HB=16, W=128, NOPE=448,
                                                        ROWS=False), 4),
        (AP._prep_kernel, "kvw_ptr freqs_ptr", dict(H=64, DH=512, HB=16, W=1, NOPE=448,
                                                        ROWS=True), 4),
        # ROWS: the speculative verify rows (program_id(2) the row, the ring written after)
        *[(A._attn_kernel, "sink_ptr freqs_ptr pm_ptr pl_ptr pacc_ptr",
           {**attn, **split, "ROWS": rows}, 4) for rows in (False, True)],
        *[(A._combine_kernel, "pm_ptr pl_ptr pacc_ptr sink_ptr freqs_ptr",
           dict(H=64, DH=512, HC=pl["hc"], BD=pl["bd"], NSPLIT=pl["nsplit"], NOPE=448, W=128,
                ROWS=rows), 4) for rows in (False, True)],
        (A._ring_write_kernel, "", dict(W=128, DH=512), 4),
        # a ratio-128 layer at 1M tokens: attn_config's long-context tiles and splits
        *[(A._attn_kernel, "sink_ptr freqs_ptr pm_ptr pl_ptr pacc_ptr",
           {**attn, "R": 128, "KC": 8125, "MODE": A.MODE_RATIO, "ROWS": False, "HB": lp["hb"],
            "BN": lp["bn"], "BPS": lp["bps"], "NSPLIT": lp["nsplit"]}, lp["num_warps"]),
          (A._combine_kernel, "pm_ptr pl_ptr pacc_ptr sink_ptr freqs_ptr",
           dict(H=64, DH=512, HC=lp["hc"], BD=lp["bd"], NSPLIT=lp["nsplit"], NOPE=448, W=128,
                ROWS=False), 4)],
        (I._query_kernel, "freqs_ptr", dict(H=64, DI=128, HQ=16, NOPE=64, F32=False), 4),
        # SUB: the tiles a program takes (1; SCORES_SUB on long caches), STAGES: in flight
        *[(I._scores_kernel, "", dict(H=64, HP=64, DI=128, BT=I.BT, SUB=sub, STAGES=stages,
                                      TRANS=trans, F32=False), 4)
          for sub, stages in ((1, 1), (I.SCORES_SUB, I.SCORES_STAGES)) for trans in (False, True)],
        # T: the rows of one launch (1: a decode step, 4: verify rows)
        *[(C._compressor_kernel, comp, dict(R=4, DC=512, OVERLAP=True, ROTATE=False, NOPE=448,
                                            RB=4, T=t), 8) for t in (1, 4)],
        (C._compressor_kernel, comp, dict(R=128, DC=512, OVERLAP=False, ROTATE=False, NOPE=448,
                                          RB=16, T=1), 8),
        (C._compressor_kernel, comp, dict(R=4, DC=128, OVERLAP=True, ROTATE=True, NOPE=64, RB=4,
                                          T=1), 4),
    ]
    for fn, f32, const, nw in jobs:
        const = dict(const, PDL=True)
        sig = {a: "constexpr" if a in const else "fp32" if a in ("eps", "scale", "wscale") else
               "i32" if a == "N" else "*i64" if a in ("pos_ptr", "idx_ptr") else
               "*fp32" if a in f32.split() else "*bf16" for a in fn.arg_names}
        triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": nw})
    print("ok")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_attention_kernels_compile_sm90():
    """Every kernel compiles for sm_90 at the Flash shapes (here, or in a subprocess without the
    interpreter where it is on: conftest.compile_here_or_apart; no GPU needed when triton ships
    ptxas)."""
    from conftest import compile_here_or_apart
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                       str(REPO / "tests/dsv4/kernels")]))
    env.pop("TRITON_INTERPRET", None)
    code = "import test_attention_kernels_compile as T; T._compile_all()"
    p = compile_here_or_apart(_compile_all, [sys.executable, "-c", code], env, timeout=600)
    if p.returncode and "ptxas" in p.stderr and "not found" in p.stderr.lower():
        pytest.skip("no ptxas for an sm_90 compile")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-4000:]
