"""Ahead-of-time compile of the kernels for sm_90 with no GPU (Triton's bundled ptxas): catches compile
errors and register spills of the launch configs the real Flash / Pro shapes use, on any machine.
Run: `python -m dsv4.kernels.aot` (prints registers / spills per variant); tested in test_decode_kernels.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..weights.presets import get_preset
from .decode.argmax import BLOCK as ARGMAX_BLOCK
from .decode.argmax import NUM_WARPS as ARGMAX_WARPS
from .decode.argmax import _argmax_kernel
from .decode.bf16_linear import FP_FUSION as BF16_FP_FUSION
from .decode.bf16_linear import _bf16_gemv_kernel, bf16_config
from .decode.fp4_experts import _fp4_down_kernel, _fp4_up_kernel, down_config, up_config
from .decode.fp8_linear import _fp8_gemv_kernel, fp8_config
from .decode.route import SCORE_FUNCS, _route_kernel

FP8_SIG = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "w3_ptr": "*u8", "s3_ptr": "*u8",
           "y_ptr": "*bf16", "wb_ptr": "*u8", "sb_ptr": "*u8", "yb_ptr": "*bf16", "add_ptr": "*fp32",
           "limit": "fp32"}
BF16_SIG = {"x_ptr": "*bf16", **{f"{w}{i}": f"*{'bf16' if w == 'w' else 'fp32'}"
                                 for i in range(5) for w in "wy"}}
ROUTE_SIG = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "tid2eid_ptr": "*i64", "ids_ptr": "*i64",
             "w_ptr": "*fp32", "idx_ptr": "*i64", "route_scale": "fp32"}
UP_SIG = {"x_ptr": "*bf16", "idx_ptr": "*i64", "rw_ptr": "*fp32", "w1_ptr": "*i32", "s1_ptr": "*u8",
          "w3_ptr": "*i32", "s3_ptr": "*u8", "a_ptr": "*bf16", "limit": "fp32"}
DOWN_SIG = {"a_ptr": "*bf16", "idx_ptr": "*i64", "w2_ptr": "*i32", "s2_ptr": "*u8", "add_ptr": "*bf16",
            "y_ptr": "*bf16"}


def variants(preset: str) -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, signature, constexprs, num_warps) for every launch the preset's decode makes."""
    c = get_preset(preset)
    D, Rq, H, Dh, G, R, I = (c.dim, c.q_lora_rank, c.n_heads, c.head_dim, c.o_groups, c.o_lora_rank,
                             c.moe_inter_dim)
    out = []
    fp8 = [("wq_a+wkv", Rq + Dh, D, 1, True, False), ("wq_b", H * Dh, Rq, 1, True, False),
           ("idx.wq_b", c.index_n_heads * c.index_head_dim, Rq, 1, True, False),
           ("wo_a", G * R, H * Dh // G, G, False, False), ("wo_b", D, G * R, 1, True, False),
           ("shared.w1+w3", I, D, 1, True, True), ("shared.w2", D, I, 1, True, False)]
    for name, n, k, groups, quant, dual in fp8:
        cfg = fp8_config(n, k, n // groups, dual)
        ce = dict(K=k, NG=n // groups, PA=(Rq if name == "wq_a+wkv" else n) // cfg.bn, QUANT=quant,
                  SWIGLU=dual, HAS_LIMIT=dual, TWO=name == "wq_a+wkv", HAS_ADD=name.endswith("add"),
                  NATIVE=True, BN=cfg.bn, NB=cfg.nb, EVEN_K=k % (cfg.nb * 128) == 0,
                  PREFETCH=cfg.prefetch and cfg.nb * 128 < k, PDL=True)
        out.append((f"fp8.{name}", _fp8_gemv_kernel, FP8_SIG, ce, cfg.num_warps))
    side = [2 * Dh, 2 * Dh, 2 * c.index_head_dim, 2 * c.index_head_dim, c.index_n_heads]
    for name, ns, xdt in [("gate", [c.n_routed_experts], "*bf16"), ("side.r4", side, "*bf16"),
                          ("side.r128", [Dh, Dh], "*bf16"), ("head", [c.vocab_size], "*fp32")]:
        cfg = bf16_config(sum(ns), D)
        bk = cfg.nb * 128
        nz = ns + [0] * (5 - len(ns))
        for tr in (1, 2, 4) if name != "gate" else (1,):     # the verify rows: 2 and 4 a program
            ce = dict(**{f"N{i}": n for i, n in enumerate(nz)}, NSEG=len(ns), K=D, BN=cfg.bn,
                      BK=bk, EVEN_K=D % bk == 0, TR=tr, PDL=True)
            out.append((f"bf16.{name}" + (f".r{tr}" if tr > 1 else ""), _bf16_gemv_kernel,
                        dict(BF16_SIG, x_ptr=xdt), ce, cfg.num_warps))
    E = c.n_routed_experts
    for hashed in (False, True):
        ce = dict(E=E, EP=triton.next_power_of_2(E), K=c.n_activated_experts,
                  KP=triton.next_power_of_2(c.n_activated_experts),
                  SCORE=SCORE_FUNCS[c.score_func], HASH=hashed, ACC=True, PDL=True)
        out.append((f"route.{'hash' if hashed else 'score'}", _route_kernel, ROUTE_SIG, ce, 4))
    k = c.n_activated_experts
    cu, cd = up_config(k, I, D), down_config(k, I, D)
    out.append(("fp4.up", _fp4_up_kernel, UP_SIG,
                dict(I=I, D=D, HAS_LIMIT=True, BN=cu.bn, NB=cu.nb, EVEN_K=D % (cu.nb * 128) == 0,
                     NATIVE=True, PDL=True), cu.num_warps))
    out.append(("fp4.down", _fp4_down_kernel, DOWN_SIG,
                dict(D=D, I=I, TOPK=k, BN=cd.bn, NB=cd.nb, EVEN_K=I % (cd.nb * 128) == 0,
                     HAS_ADD=True, NATIVE=True, PDL=True), cd.num_warps))
    for xdt in ("*fp32", "*bf16"):                # the greedy pick of the head's logits
        out.append((f"argmax.{xdt[1:]}", _argmax_kernel,
                    {"x_ptr": xdt, "out_ptr": "*i64", "V": "i32", "stride": "i32"},
                    dict(BLOCK=ARGMAX_BLOCK), ARGMAX_WARPS))
    return out


def compile_variant(kernel, sig: dict, constexprs: dict, num_warps: int, arch: int = 90,
                    num_stages: int | None = None):
    """Compile for cuda sm_`arch` with the 16-byte pointer alignment the JIT would specialize on
    (num_stages: the launch's, default Triton's)."""
    names = kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    sig = dict(sig, **{a: "constexpr" for a in constexprs})
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps,
                                                                 "num_stages": num_stages}
    if kernel is _bf16_gemv_kernel:         # launched without FMA contraction
        opts["enable_fp_fusion"] = BF16_FP_FUSION
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def resources(compiled) -> dict:
    """Registers / stack / local bytes from cuobjdump (empty when the tool is not bundled)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        txt = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", txt)}


def main(argv=None) -> int:
    presets = (argv or sys.argv[1:]) or ["flash", "pro"]
    for p in presets:
        for name, kern, sig, ce, nw in variants(p):
            r = resources(compile_variant(kern, sig, ce, nw))
            shown = {k: v for k, v in ce.items() if k in ("K", "BN", "NB", "BK", "EVEN_K")}
            print(f"{p:6} {name:18} {shown} warps={nw} {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
