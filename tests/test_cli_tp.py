"""`dsv4 decode --parallel tp` as users drive it, on the CPU (two gloo ranks): the same JSON contract
as one process, rank 0's streamed text, the logits of the one-process run (within what a flipped
FP8 rounding of the KV fake-quant can move them: the exact agreement is
tests/dsv4/parallel/test_tp_model.py's), and every bad combination refused before anything loads."""
import json

import numpy as np
import pytest

from helpers import SMALL, small_checkpoint
from test_cli import _one_error_line, run, run_here

TP_CFG = SMALL.replace(vocab_size=2047, moe_inter_dim=256)     # splits over two ranks
FLIP_BOUND = 0.15       # tests/dsv4/test_prefill.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("cli-tp"), "bf16", cfg=TP_CFG)


def test_tp_decode_on_two_cpu_ranks(ckpt, tmp_path):
    base = ["--ckpt", str(ckpt), "--prompt-ids", "5,6,7,8,9", "--force-ids", "11,12,13,14",
            "--dtype", "float32", "--json"]
    p = run(*base, "--parallel", "tp", "--device", "cpu,cpu", "--dump-logits",
            str(tmp_path / "tp.npy"), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["parallel"] == "tp" and out["device"] == "cpu,cpu" and out["mode"] == "eager"
    assert out["output_ids"] == [11, 12, 13, 14] and out["finish_reason"] == "length"
    assert out["text"] and out["text"] in p.stderr            # rank 0 streamed it
    assert out["timings"]["decode_tok_per_s"] > 0 and out["backend"]["decode.mhc"] == "torch"
    # the one-process run: decode's main in this process (the TP run above is the user's)
    one = run_here(*base, "--device", "cpu", "--dump-logits", str(tmp_path / "one.npy"))
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["text"] == out["text"]
    a, b = np.load(tmp_path / "tp.npy"), np.load(tmp_path / "one.npy")
    assert a.shape == b.shape == (4, TP_CFG.vocab_size)
    err = float((np.abs(a - b).max(1) / np.abs(b).max(1)).max())
    assert err < FLIP_BOUND, f"TP logits differ from one process by {err:.3g} of their size"


@pytest.mark.parametrize("flags, words", [
    (["--device", "cpu"], ["--parallel tp --device cpu", "at least two"]),
    (["--device", "cpu,cpu,cpu"], ["3 ranks", "allowed 2, 4, 8"]),
    (["--device", "cpu,cpu", "--profile", "torch"], ["--profile with --parallel tp"]),
    (["--device", "cpu,cpu", "--prefill-graphs", "8"],
     ["--prefill-graphs 8 needs graph mode", "--prefill-graphs 0"]),   # CPU ranks: eager
])
def test_tp_bad_flags_fail_before_loading(ckpt, flags, words):
    _one_error_line(run_here("--ckpt", str(ckpt), "--prompt-ids", "5,6", "--parallel", "tp",
                             *flags), *words)


def test_tp_refuses_a_checkpoint_it_cannot_split(tmp_path):
    fp8 = small_checkpoint(tmp_path, "fp8")         # expert rows of 64 per rank: not whole blocks
    _one_error_line(run_here("--ckpt", str(fp8), "--prompt-ids", "5,6", "--parallel", "tp",
                             "--device", "cpu,cpu"), "cannot be split over 2 ranks",
                    "--parallel pipeline")


def _chat(ckpt, *flags):
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "dsv4", "chat", "--ckpt", str(ckpt), "--dtype",
                           "float32", "--max-new-tokens", "5", *flags],
                          input="Hello there\n/reset\nA new start\nAnd a follow-up\n",
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory):
    """A checkpoint of the tiny-tp preset (the tokenizer's vocabulary; splits over two ranks)."""
    from dsv4.weights.presets import TINY_TP
    return small_checkpoint(tmp_path_factory.mktemp("cli-tp-tiny"), "bf16", cfg=TINY_TP)


# `dsv4 decode --parallel tp` of the chat's first message: what the chat's first answer and the
# torchrun run are compared with
TP_DECODE = ["--prompt", "Hello there", "--max-new-tokens", "5", "--dtype", "float32",
             "--parallel", "tp", "--device", "cpu,cpu", "--json"]


@pytest.fixture(scope="module")
def tp_decode(tiny_tp, tmp_path_factory):
    """`dsv4 decode TP_DECODE` on tiny_tp (TINY_TP's checkpoint, the same bytes wherever it is
    written), run once for the test run (pytest-xdist may hand the two tests that read it to
    different workers): its JSON object."""
    from helpers import once_per_run

    def make():     # decode's main here: it launches its two ranks (the user's run: the tests)
        d = run_here("--ckpt", str(tiny_tp), *TP_DECODE, env={"OMP_NUM_THREADS": "1"})
        assert d.returncode == 0, d.stderr
        return json.loads(d.stdout)
    return once_per_run(tmp_path_factory, "cli-tp-decode", make)


def test_tp_chat_answers_as_tp_decode(tiny_tp, tp_decode):
    """`dsv4 chat --parallel tp` through a pipe (this process rank 0, the other following it):
    its first answer is what `dsv4 decode --parallel tp` gives for the same message (the same
    split sums: the same bits on any machine); turns continue, /reset starts afresh (the first
    turn again gives the first answer's tokens), and the run ends cleanly."""
    tp = _chat(tiny_tp, "--parallel", "tp", "--device", "cpu,cpu")
    assert tp.returncode == 0, tp.stderr
    assert "device=cpu,cpu tensor-parallel" in tp.stderr and "new conversation" in tp.stderr
    answers = tp.stdout.split("[end of answer]\n")
    assert len(answers) == 4 and answers[-1] == ""
    if tp_decode["finish_reason"] == "length":   # (an EOS would end the chat's answer alike)
        assert answers[0].rstrip("\n") == tp_decode["text"]


STOP_SCRIPT = r'''
import json, sys, torch
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.sampling import SamplingParams
from dsv4.runtime.session import Session, load_model
from dsv4.runtime.tp import open_session
ckpt = sys.argv[1]
rt = RuntimeConfig(max_seq_len=64, dtype=torch.float32)
kw = dict(params=SamplingParams(temperature=0.8, top_p=0.9, seed=3), mode="eager")

def turns(s):
    seen = []
    a = s.generate([5, 6, 7], 6, on_token=lambda t: seen.append(t) or len(seen) == 2)
    b = s.generate([9, 10], 3, continue_sequence=True)
    bad = None
    try:
        s.generate([5], 0)
    except Exception as e:
        bad = type(e).__name__
    c = s.generate([11], 2, continue_sequence=True)
    return [a.output_ids, a.finish_reason, b.output_ids, bad, c.output_ids, s.length]

tp, _ = open_session(["cpu", "cpu"], ckpt, rt, kw)
with tp:
    got = turns(tp)
m, ck = load_model(ckpt, rt)
ck.close()
with Session(m, **kw) as s:
    want = turns(s)
print(json.dumps([got, want]))
'''


def test_tp_session_stops_where_rank_0_stops(ckpt):
    """A MirroredSession (dsv4.runtime.tp.open_session): rank 0's on_token stops the generation
    on every rank at the same token; a request refused on rank 0 (max_new_tokens 0) leaves the
    followers in step; later turns continue alike; seeded sampling as one process."""
    import os
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", STOP_SCRIPT, str(ckpt)], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    got, want = json.loads(p.stdout.strip().splitlines()[-1])
    assert got[1] == "stopped" and len(got[0]) == 2 and got[3] == "InputError"
    assert got == want


def test_tp_decode_under_torchrun(tiny_tp, tp_decode):
    """`torchrun --nproc-per-node 2 scripts/decode.py --parallel tp ...`: each process is the rank
    torchrun made it; rank 0 prints the one JSON object, the other nothing; the tokens of the
    run dsv4 launches itself (the same split sums; the same command as tp_decode's)."""
    import os
    import shutil
    import subprocess
    import sys
    from conftest import REPO
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which(
        "torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2",
                        str(REPO / "scripts" / "decode.py"), "--ckpt", str(tiny_tp), *TP_DECODE],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, p.stdout
    got = json.loads(lines[0])
    assert got["output_ids"] == tp_decode["output_ids"] and len(got["output_ids"]) >= 1
