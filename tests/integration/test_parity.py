"""Parity with the official DeepSeek-V4 reference on the shared parity checkpoints, both precisions,
through the Python API and the CLI (how to compare: ../shared/data/parity/README.md)."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, parity_case_dir
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session, load_model

CASES = [("p1-bf16-3layer", "fp32"), ("p1-bf16-3layer", "bf16"),
         ("p2-fp8-2layer", "fp32"), ("p2-fp8-2layer", "bf16")]
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def load_case(name, mode):
    d = parity_case_dir(name)
    case = json.loads((d / "case.json").read_text())
    g = np.load(d / f"golden-{mode}.npz")
    return d, case, g["logits"], g["tokens"].tolist()


def margins(golden):
    top2 = np.sort(golden, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def check_logits(logits, golden, tol, what, exact_argmax=True):
    err = np.linalg.norm(logits - golden, axis=1) / np.linalg.norm(golden, axis=1)
    med, p95 = float(np.median(err)), float(np.percentile(err, 95))
    assert med < tol["median"] and p95 < tol["p95"], \
        f"{what}: relative L2 median {med:.3g} / p95 {p95:.3g} vs tolerance {tol}"
    if not exact_argmax:      # bfloat16: only the loose bounds hold (parity README)
        return
    sure = margins(golden) > 1e-3
    bad = np.nonzero(sure & (logits.argmax(1) != golden.argmax(1)))[0]
    assert bad.size == 0, f"{what}: argmax differs on rows {bad.tolist()} (margin > 1e-3)"


def check_free_running(tokens, golden, gtokens, what):
    m = margins(golden)
    first_small = next((i for i, v in enumerate(m) if v <= 1e-3), len(gtokens))
    assert tokens[:first_small] == gtokens[:first_small], f"{what}: greedy tokens diverge"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,mode", CASES)
def test_parity_api(name, mode, device):
    d, case, golden, gtokens = load_case(name, mode)
    rt = RuntimeConfig(max_seq_len=256, dtype=DTYPE[mode], devices=(device,))
    model, ck = load_model(d, rt)
    ck.close()
    s = Session(model, SamplingParams(), mode="eager")
    n = case["max_new_tokens"]
    forced = s.generate(case["prompt_ids"], n, force_ids=gtokens, keep_logits=True)
    assert forced.output_ids == gtokens and forced.logits.shape == golden.shape
    check_logits(forced.logits.numpy(), golden, case["modes"][mode]["tolerance"],
                 f"{name}/{mode}/{device}", exact_argmax=mode == "fp32")
    if mode == "fp32":
        free = s.generate(case["prompt_ids"], n, eos_id=None)
        check_free_running(free.output_ids, golden, gtokens, f"{name}/{mode}/{device}")
    s.close()


def run_cli(*args, timeout=300):
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "decode.py"), *args],
                       capture_output=True, text=True, timeout=timeout)
    return p


@pytest.mark.parametrize("name,mode", CASES)
def test_parity_cli(name, mode, tmp_path):
    d, case, golden, gtokens = load_case(name, mode)
    dump = tmp_path / "logits.npy"
    ids = ",".join(map(str, case["prompt_ids"]))
    # the script as users run it (fp32); bf16 runs its main in this process (~4 s of imports less)
    from test_cli import run_here
    p = (run_cli if mode == "fp32" else run_here)(
        "--ckpt", str(d), "--prompt-ids", ids, "--force-ids", ",".join(map(str, gtokens)),
        "--dtype", {"fp32": "float32", "bf16": "bfloat16"}[mode], "--device", "cpu",
        "--temperature", "0", "--dump-logits", str(dump), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["output_ids"] == gtokens and out["prompt_ids"] == case["prompt_ids"]
    assert out["finish_reason"] == "length" and out["mode"] == "eager" and out["dtype"] in (
        "float32", "bfloat16")
    check_logits(np.load(dump), golden, case["modes"][mode]["tolerance"], f"cli {name}/{mode}",
                 exact_argmax=mode == "fp32")
    if mode != "fp32":
        return
    # free-running: the script's main in this process (the forced run above is the user's)
    p = run_here("--ckpt", str(d), "--prompt-ids", ids, "--max-new-tokens", str(len(gtokens)),
                 "--dtype", {"fp32": "float32", "bf16": "bfloat16"}[mode], "--device", "cpu",
                 "--temperature", "0", "--json")
    assert p.returncode == 0, p.stderr
    check_free_running(json.loads(p.stdout)["output_ids"], golden, gtokens, f"cli {name}/{mode}")
