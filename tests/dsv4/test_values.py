"""A shard of the right size with corrupt bytes: the load names the tensor and the file
(dsv4.weights.values) instead of failing far away (before: `index -1 is out of bounds ... Fixes:
lower --max-seq-len, --mode eager` from a routing table of -1s, or NaN logits)."""
from __future__ import annotations

import json
import random
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from helpers import SMALL, small_checkpoint

SHARD1 = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("values"), "fp8")


def corrupted(ckpt, tmp_path, edit) -> "Path":
    """A copy of ckpt whose shards' data bytes edit(name -> (file, begin, end), bytearray of that
    file, data offset) rewrote in place: same sizes, same headers."""
    out = tmp_path / "ckpt"
    shutil.copytree(ckpt, out)
    for f in sorted(out.glob("*.safetensors")):
        raw = bytearray(f.read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        hdr = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
        edit(f.name, hdr, raw, 8 + n)
        f.write_bytes(bytes(raw))
    return out


ARGS = ("--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--device", "cpu")


def decode(ckpt):
    """`dsv4 decode` on ckpt as users run it (a subprocess: ~4 s of imports)."""
    return subprocess.run([sys.executable, "-m", "dsv4", "decode", "--ckpt", str(ckpt), *ARGS],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def decode_here(ckpt):
    """The same command's main in this process (its exit status and what it prints): the other
    corrupt values, whose error line is all that is read."""
    from dsv4.cli.main import main
    from helpers import run_main
    return run_main(main, ["decode", "--ckpt", str(ckpt), *ARGS], ["dsv4"])


def error_line(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def fill(tensor: str, byte: int, count: int | None = None):
    """An edit writing `byte` over the first `count` bytes (all: None) of `tensor`."""
    def edit(fname, hdr, raw, base):
        if tensor in hdr:
            b, e = hdr[tensor]["data_offsets"]
            e = e if count is None else b + count
            raw[base + b:base + e] = bytes([byte]) * (e - b)
    return edit


def test_random_bytes_in_a_shard_name_a_tensor_and_the_file(ckpt, tmp_path):
    def noise(fname, hdr, raw, base):
        if fname == SHARD1:
            r = random.Random(0)
            raw[base:] = bytes(r.getrandbits(8) for _ in range(len(raw) - base))
    line = error_line(decode_here(corrupted(ckpt, tmp_path, noise)))
    assert f"ckpt/{SHARD1}: tensor " in line and "download it again" in line, line


def test_a_routing_table_of_minus_ones(ckpt, tmp_path):
    """The issue's case: tid2eid bytes 0xFF (-1 as int64) gave an index error inside a step."""
    name = "layers.0.ffn.gate.tid2eid"
    assert SMALL.is_hash_layer(0)
    line = error_line(decode(corrupted(ckpt, tmp_path, fill(name, 0xFF))))
    for part in (f"{SHARD1}: tensor {name} routes tokens to experts -1..-1",
                 f"outside 0..{SMALL.n_routed_experts - 1}", "n_routed_experts"):
        assert part in line, (part, line)
    assert "out of bounds" not in line and "--max-seq-len" not in line


def test_a_nan_scale(ckpt, tmp_path):
    name = "layers.1.ffn.experts.3.w2.scale"           # FP4 expert scales: e8m0, 0xFF is NaN
    line = error_line(decode_here(corrupted(ckpt, tmp_path, fill(name, 0xFF, count=2))))
    assert f"tensor {name} holds 2 NaN scale(s) (e8m0 byte 0xFF)" in line, line


def test_a_nan_in_a_small_float_tensor(ckpt, tmp_path):
    name = "layers.2.attn.attn_sink"                   # F32 [n_heads]
    line = error_line(decode_here(corrupted(ckpt, tmp_path, fill(name, 0xFF, count=4))))
    assert f"tensor {name} holds 1 non-finite value(s)" in line, line


def test_every_legal_value_passes_and_fp8_weights_are_not_read_again():
    from dsv4.weights.values import check_values
    e8m0 = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)   # 2^-127 .. 2^127
    check_values("x.scale", "F8_E8M0", e8m0, "f", 16)
    check_values("layers.0.ffn.gate.tid2eid", "I64", torch.tensor([[0, 15]]), "f", 16)
    with pytest.raises(Exception, match="experts 0..16, outside 0..15"):
        check_values("layers.0.ffn.gate.tid2eid", "I64", torch.tensor([[0, 16]]), "f", 16)
    big = torch.tensor([3e38, 3e38, -3e38])          # a sum would overflow; min and max do not
    check_values("x.weight", "F32", big, "f", 16)
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(Exception, match="holds 1 non-finite value"):
            check_values("x.weight", "BF16", torch.tensor([1.0, bad]).bfloat16(), "f", 16)
    nan_fp8 = torch.full((4,), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    check_values("x.weight", "F8_E4M3", nan_fp8, "f", 16)          # not checked (the bulk)
