"""Cheap checks of a checkpoint tensor's values as it loads (Checkpoint.load_into): the bytes of
a shard of the right size can still be corrupt, and a corrupt routing table or scale otherwise
surfaces far away (an index error inside a decode step, NaN logits). Checked, each with one
reduction over bytes already in memory (no second read of the file): every e8m0 scale (no NaN
code 0xFF), the hash-routing table `gate.tid2eid` (expert ids within 0..n_routed_experts-1) and
every float tensor (BF16 / F32: finite). That is 7% of Flash's bytes (8.3 GiB of scales, 2.8 GiB
of floats, of 148.6 GiB). Not checked: FP4 codes (every nibble is a number) and FP8 weight bytes
(NaN codes 0x7F / 0xFF): they are the other 93%.
"""
from __future__ import annotations

import torch

from ..errors import CorruptFileError

E8M0_NAN = 0xFF                    # the one e8m0 code that is not a power of two
FLOATS = ("F32", "BF16", "F16", "F64")    # stored float dtypes checked finite (not FP8 weights)
REDOWNLOAD = "the file's size is right but its bytes are not: download it again"


def check_values(name: str, stored_dtype: str, src: torch.Tensor, where: str,
                 n_routed_experts: int) -> None:
    """CorruptFileError naming tensor `name` and its file `where` when `src` (as stored) holds
    values the checkpoint format cannot hold; what is checked: the module docstring."""
    if not src.numel():
        return
    if stored_dtype == "F8_E8M0":
        u8 = src.view(torch.uint8)
        if int(u8.max()) == E8M0_NAN:          # max() reads the bytes once, no mask tensor
            n = int((u8 == E8M0_NAN).sum())
            raise CorruptFileError(f"{where}: tensor {name} holds {n} NaN scale(s) (e8m0 byte "
                                   f"0xFF) of {u8.numel()}: {REDOWNLOAD}")
    elif name.endswith("gate.tid2eid"):
        lo, hi = (int(t) for t in torch.aminmax(src))
        if lo < 0 or hi >= n_routed_experts:
            raise CorruptFileError(f"{where}: tensor {name} routes tokens to experts "
                                   f"{lo}..{hi}, outside 0..{n_routed_experts - 1} "
                                   f"(n_routed_experts = {n_routed_experts} in config.json): "
                                   f"{REDOWNLOAD} (or fix n_routed_experts if config.json is "
                                   f"the one that is wrong)")
    elif stored_dtype in FLOATS:
        # one reduction pass (NaN propagates into min and max, +-inf is one of them); the
        # mask of isfinite() is ~10x slower on a CPU and runs only to count what is wrong
        lo, hi = torch.aminmax(src)
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            n = int((~torch.isfinite(src)).sum())
            raise CorruptFileError(f"{where}: tensor {name} holds {n} non-finite value(s) "
                                   f"(NaN or inf) of {src.numel()}: {REDOWNLOAD}")
