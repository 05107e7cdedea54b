"""scripts/decode.py as users drive it: the flag contract, JSON, exit codes and every bad input."""
import json
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from helpers import small_checkpoint

SCRIPT = str(REPO / "scripts" / "decode.py")


def run(*args, env=None, timeout=300):
    import os
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def run_here(*args, env=None):
    """scripts/decode.py's main in this process (sys.exit(main()) there: its return value, or
    argparse's SystemExit code, is the exit status; stdout / stderr as the script prints them;
    `env` set for the call), for the runs that stop at an error and the reference runs a test
    compares the script's output with: a subprocess adds ~4 s of imports to each. The script
    itself exits 2 with one error line in test_a_bad_flag_exits_2_from_the_script (`python -m
    dsv4 serve` in tests/test_cli_startup.py), and every other test here runs it at least once."""
    from dsv4.cli.decode import main
    from helpers import run_main
    return run_main(main, args, [SCRIPT], env)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("cli"), "fp8")


def _one_error_line(p, *words):
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in p.stderr
    return lines[0]


def test_json_contract(ckpt):
    p = run("--ckpt", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--json",
            "--temperature", "0.7", "--seed", "123", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)                            # exactly one JSON object on stdout
    for k in ("prompt_ids", "output_ids", "text", "finish_reason", "device", "mode", "dtype",
              "seed", "timings"):
        assert k in out
    for k in ("load_s", "capture_s", "prefill_s", "decode_s", "decode_tok_per_s", "ms_per_token"):
        assert k in out["timings"]
    assert out["prompt_ids"] == [5, 6, 7, 8] and len(out["output_ids"]) <= 6
    assert out["seed"] == 123 and out["mode"] == "eager" and out["device"] == "cpu"
    assert out["granularity"] is None                    # no graphs in eager mode
    again = json.loads(run_here("--ckpt", str(ckpt), "--prompt-ids", "5,6,7,8", "--max-new-tokens",
                                "6", "--json", "--temperature", "0.7", "--seed", "123").stdout)
    assert again["output_ids"] == out["output_ids"]      # seeded sampling is reproducible


def test_force_ids_run_exactly_that_many_steps(ckpt, tmp_path):
    dump = tmp_path / "l.npy"
    p = run("--ckpt", str(ckpt), "--prompt-ids", "1,2,3", "--force-ids", "1,1,9", "--json",
            "--dump-logits", str(dump))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["output_ids"] == [1, 1, 9] and out["finish_reason"] == "length"
    import numpy as np
    assert np.load(dump).shape == (3, 2048)


@pytest.mark.parametrize("args,words", [
    (["--prompt", ""], ["empty"]),
    (["--prompt-ids", "1,2,x"], ["--prompt-ids", "integers"]),
    (["--prompt-ids", "1,,2"], ["--prompt-ids '1,,2'", "item 2 is empty"]),
    (["--prompt-ids", "1,2", "--force-ids", ",3"], ["--force-ids ',3'", "item 1 is empty"]),
    (["--prompt-ids", ","], ["--prompt-ids is empty"]),
    (["--prompt-ids", "5,99999"], ["99999", "2048"]),
    (["--prompt-ids", "-3"], ["-3", "2048"]),
    # "7 8" was read as the id 78 (every space dropped); spaces around an item are still fine
    (["--prompt-ids", " 1, 2 ", "--force-ids", "7 8"], ["--force-ids '7 8'", "comma-separated"]),
    (["--force-ids", "1,70000", "--prompt-ids", "1"], ["70000", "2048"]),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "300", "--max-seq-len", "64"],
     ["303", "64", "--max-seq-len", "--max-new-tokens"]),
    (["--prompt-ids", "1,2", "--mode", "graph", "--device", "cpu"], ["CUDA", "--mode"]),
    (["--prompt-ids", "1,2", "--temperature", "-1"], ["--temperature"]),
    (["--prompt-ids", "1,2", "--top-p", "0"], ["--top-p"]),
    (["--prompt-ids", "1,2", "--bogus"], ["--bogus"]),
    (["--prompt-file", "/nonexistent/p.txt"], ["--prompt-file", "/nonexistent/p.txt"]),
    (["--prompt-ids", "1,2", "--profile-steps", "9-3", "--profile", "torch"], ["--profile-steps"]),
    (["--prompt-ids", "1,2", "--prefill-chunk", "0"], ["--prefill-chunk", ">= 1"]),
    (["--prompt-ids", "1,2", "--prefill-graphs", "6"], ["--prefill-graphs 6", "power of two"]),
    (["--prompt-ids", "1,2", "--device", "cpu", "--prefill-graphs", "8"],
     ["--prefill-graphs 8", "graph mode", "--prefill-graphs 0"]),
    (["--prompt-ids", "1,2", "--speculative", "-1"], ["--speculative -1", "0 (off) or 1"]),
    (["--prompt-ids", "1,2", "--speculative", "3"], ["--speculative 3", "not implemented"]),
    (["--prompt-ids", "1,2", "--speculative", "1", "--speculative-min-acceptance", "1.5"],
     ["--speculative-min-acceptance 1.5", "[0, 1]"]),
])
def test_bad_inputs_exit_2(ckpt, args, words):
    _one_error_line(run_here("--ckpt", str(ckpt), *args), *words)


def test_a_bad_flag_exits_2_from_the_script(ckpt):
    """The script as users run it: exit status 2 and one error line (the cases above call its
    main in this process)."""
    _one_error_line(run("--ckpt", str(ckpt), "--prompt-ids", "1,2", "--bogus"), "--bogus")


def test_a_prompt_file_that_is_not_utf8_exits_2(ckpt, tmp_path):
    """(It was exit 1, `runtime error: UnicodeDecodeError`.)"""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9".encode("latin-1"))
    _one_error_line(run_here("--ckpt", str(ckpt), "--prompt-file", str(bad)),
                    "--prompt-file", "not UTF-8", "0xe9", "offset 3")


def test_no_prompt_with_ckpt(ckpt):
    _one_error_line(run_here("--ckpt", str(ckpt)), "no prompt")


def test_bad_checkpoints_exit_2(ckpt, tmp_path):
    _one_error_line(run_here("--ckpt", str(tmp_path / "missing"), "--prompt-ids", "1,2"),
                    str(tmp_path / "missing"))
    bad = tmp_path / "c1"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").unlink()
    _one_error_line(run_here("--ckpt", str(bad), "--prompt-ids", "1,2"), "config")
    bad = tmp_path / "c2"
    shutil.copytree(ckpt, bad)
    (bad / "model-00002-of-00002.safetensors").unlink()
    _one_error_line(run_here("--ckpt", str(bad), "--prompt-ids", "1,2"),
                    "model-00002-of-00002.safetensors")
    bad = tmp_path / "c3"
    shutil.copytree(ckpt, bad)
    f = bad / "model-00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    _one_error_line(run_here("--ckpt", str(bad), "--prompt-ids", "1,2"),
                    "model-00001-of-00002.safetensors")
    bad = tmp_path / "c4"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["scoring_func"] = "tanh"
    (bad / "config.json").write_text(json.dumps(cfg))
    _one_error_line(run_here("--ckpt", str(bad), "--prompt-ids", "1,2"), "scoring_func", "tanh",
                    "config.json")
    bad = tmp_path / "c5"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_intermediate_size"] = 256              # every expert tensor now has the wrong shape
    (bad / "config.json").write_text(json.dumps(cfg))
    _one_error_line(run_here("--ckpt", str(bad), "--prompt-ids", "1,2"), "expected", "found")


def test_demo_builds_once_and_runs(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    p = run("--demo", "--max-new-tokens", "3", "--json", env=env)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "dsv4" / "demo-tiny-v1" / "tokenizer.json").exists()
    out = json.loads(p.stdout)
    assert out["prompt_ids"][0] == 0 and out["prompt_ids"].count(0) == 1   # exactly one BOS
    p2 = run_here("--max-new-tokens", "2", env=env)                        # demo is the default
    assert p2.returncode == 0 and "building" not in p2.stderr and "demo" in p2.stderr
    # chat-encoded text prompt on the real-vocabulary model: streams, then the summary
    p3 = run_here("--prompt", "Hello there", "--system", "Be brief.", "--thinking",
                  "--max-new-tokens", "4", "--mode", "auto", env=env)
    assert p3.returncode == 0, p3.stderr
    assert "ms/token" in p3.stderr and "load" in p3.stderr
    assert " greedy " in p3.stderr and "seed" not in p3.stderr    # a greedy run draws no seed


def test_prefill_chunk_same_tokens_and_progress(ckpt):
    """--prefill-chunk changes how the prompt is read, not what is generated (float32 greedy);
    a prompt of several chunks shows a progress bar on stderr, silent with --json."""
    ids = ",".join(str(i) for i in range(100, 140))
    base = ["--ckpt", str(ckpt), "--prompt-ids", ids, "--max-new-tokens", "6", "--dtype",
            "float32", "--temperature", "0"]
    one = run_here(*base, "--json")
    chunked = run_here(*base, "--json", "--prefill-chunk", "7")
    assert one.returncode == 0 and chunked.returncode == 0, chunked.stderr
    assert json.loads(one.stdout)["output_ids"] == json.loads(chunked.stdout)["output_ids"]
    assert "prefill:" not in chunked.stderr
    shown = run(*base, "--prefill-chunk", "7")
    assert shown.returncode == 0 and "prefill:" in shown.stderr and "prefill" in shown.stderr


def test_granularity_auto_is_staged_unless_profiling():
    """--granularity auto (the default): staged graphs, or one graph per layer when --profile
    asks for the per-layer ranges and summary; a given value stays."""
    from dsv4.cli.decode import build_parser
    from dsv4.cli.options import check_runtime_args
    for flags, want in (([], "staged"), (["--profile", "torch"], "segment"),
                        (["--profile", "nsys"], "segment"), (["--granularity", "device"], "device"),
                        (["--granularity", "segment"], "segment")):
        args = build_parser().parse_args(["--device", "cpu", *flags])
        assert args.granularity == ("auto" if not flags or flags[0] == "--profile" else want)
        check_runtime_args(args)
        assert args.granularity == want, flags


def test_prefill_graphs_flag_checks():
    """--prefill-graphs is checked twice: its value before the devices resolve (a power of two
    passes whatever the device), then against the mode and --speculative."""
    from dsv4.errors import InputError
    from dsv4.runtime.config import check_prefill_graphs
    check_prefill_graphs(8)                      # the first call: the value alone
    check_prefill_graphs(8, "graph")
    check_prefill_graphs(0, "eager", True)
    for args, words in (((8, "eager"), "needs graph mode"), ((8, "graph", True), "MTP block"),
                        ((6,), "power of two")):
        with pytest.raises(InputError, match=words):
            check_prefill_graphs(*args)


@pytest.mark.cuda
def test_cli_on_cuda_flags_give_the_same_tokens(ckpt, tmp_path):
    """dsv4 decode on a GPU as users drive it (no other test runs the CLI there): greedy float32
    in graph mode (staged graphs, the default), the same prompt twice -> the same logits' bits;
    eager, --granularity segment / device and --speculative 1 -> the same tokens (the same kernels, or rows kernels that give a single
    row's bits); --prefill-graphs is refused in float32 (the prefill's torch experts read the
    host) and in bfloat16 runs and repeats itself (its pieces may sum in another order than one
    eager chunk: an FP8 rounding may flip). It once never ran from the CLI: its first
    check refused every value before the devices resolved ("needs graph mode" on CUDA too)."""
    import numpy as np
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = ["--ckpt", str(ckpt), "--prompt-ids", "5,6,7,8,9,10,11", "--max-new-tokens", "6",
            "--dtype", "float32", "--device", "cuda:0", "--json"]

    def ids(*flags, dump=None, granularity=None):
        p = run(*base, *flags, *(["--dump-logits", str(dump)] if dump else []))
        assert p.returncode == 0, (flags, p.stderr)
        out = json.loads(p.stdout)
        if granularity is not None:
            assert out["granularity"] == granularity, flags
        return out["output_ids"], out["mode"]

    first, mode = ids("--mode", "graph", dump=tmp_path / "a.npy", granularity="staged")
    again, _ = ids("--mode", "graph", dump=tmp_path / "b.npy")
    assert mode == "graph" and again == first
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert a.tobytes() == b.tobytes()                  # the same prompt twice: the same bits
    for flags, gran in ((["--mode", "eager"], None),
                        (["--mode", "graph", "--granularity", "segment"], "segment"),
                        (["--mode", "graph", "--granularity", "device"], "device"),
                        (["--mode", "graph", "--speculative", "1"], "staged")):
        assert ids(*flags, granularity=gran)[0] == first, flags
    # float32 runs the prefill on torch, whose routed experts read the routing on the host: a
    # chunk cannot be captured, and the CLI says so in its flags' words
    line = _one_error_line(run(*base, "--mode", "graph", "--prefill-graphs", "4"),
                           "activations in float32", "--prefill-graphs 0")
    assert "prefill_graphs = 0" not in line
    bf16 = [a if a != "float32" else "bfloat16" for a in base]
    p = run(*bf16, "--mode", "graph", "--prefill-graphs", "4")
    assert p.returncode == 0, p.stderr
    replayed = json.loads(p.stdout)
    again = json.loads(run(*bf16, "--mode", "graph", "--prefill-graphs", "4").stdout)
    assert replayed["mode"] == "graph" and replayed["output_ids"]
    assert again["output_ids"] == replayed["output_ids"]


def test_speculative_cli(ckpt):
    """--speculative 1: the same float32 greedy tokens as plain decoding, and the
    acceptance rate and tokens per step in the JSON object and the stats line."""
    base = ["--ckpt", str(ckpt), "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "12",
            "--dtype", "float32", "--temperature", "0", "--device", "cpu"]
    plain, spec = run_here(*base, "--json"), run(*base, "--json", "--speculative", "1")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert b["output_ids"] == a["output_ids"] and b["mode"] == "eager" and b["speculative"] == 1
    assert 0 <= b["acceptance_rate"] <= 1 and 1 <= b["tokens_per_step"] <= 2
    assert b["timings"]["acceptance_rate"] == b["acceptance_rate"]
    assert "acceptance_rate" not in a and "tokens_per_step" not in a["timings"]
    assert 1 <= b["timings"]["speculative_steps"] <= b["timings"]["steps"]
    shown = run_here(*base, "--speculative", "1")
    assert shown.returncode == 0
    assert "acceptance rate" in shown.stderr and "drafting" in shown.stderr
    always = run_here(*base, "--json", "--speculative", "1", "--speculative-min-acceptance", "0")
    c = json.loads(always.stdout)
    assert c["output_ids"] == a["output_ids"]
    assert c["timings"]["speculative_steps"] >= c["timings"]["steps"] - 1   # a last one: plain


# ---- the first hour: errors in the user's words, Ctrl-C, --help, DSpark, the dsv4 command --------

def _edited(ckpt, tmp_path, **changes):
    bad = tmp_path / "edited"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(changes)
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("changes, words", [
    ({"num_attention_heads": 5}, ["config.json: num_attention_heads = 5", "o_groups = 2"]),
    ({"hidden_size": "128"}, ["config.json: hidden_size = '128'", "integer"]),
    ({"hidden_size": 256}, ["hidden_size = 128 (embed.weight is [2048, 128])",
                            "config.json says hidden_size = 256"]),
])
def test_config_errors_in_the_users_words(ckpt, tmp_path, changes, words):
    line = _one_error_line(run_here("--ckpt", str(_edited(ckpt, tmp_path, **changes)),
                                    "--prompt-ids", "1,2"), *words)
    assert "expert_dtype" not in line and not re.search(r"\b(dim|n_heads) = ", line), line


def test_a_file_as_ckpt_is_not_a_directory(ckpt):
    _one_error_line(run_here("--ckpt", str(ckpt / "config.json"), "--prompt-ids", "1,2"),
                    "config.json is not a directory", "--ckpt")


def _interrupted(ckpt, *extra):
    """A long decode, SIGINT once the first streamed text arrives."""
    import os
    import select
    import signal
    import time
    stream = "stderr" if "--json" in extra else "stdout"
    # Ctrl-C as a terminal delivers it: SIGINT at its default in the child even where the test
    # runner was started with SIGINT ignored (a background job of a non-interactive shell, nohup),
    # which the child would inherit, and Python then never raises KeyboardInterrupt
    p = subprocess.Popen([sys.executable, SCRIPT, "--ckpt", str(ckpt), "--prompt-ids", "5,6,7",
                          "--max-new-tokens", "4000", "--temperature", "1", "--seed", "1",
                          "--device", "cpu", *extra], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pipe = getattr(p, stream)
    first = b""
    deadline = time.time() + 300
    while not first.strip() and time.time() < deadline:
        ready, _, _ = select.select([pipe], [], [], deadline - time.time())
        if ready:
            first += os.read(pipe.fileno(), 4096)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    return p.returncode, (first + out if stream == "stdout" else out).decode(), \
        (first + err if stream == "stderr" else err).decode()


def test_ctrl_c_prints_the_json_of_the_tokens_so_far(ckpt):
    rc, out, err = _interrupted(ckpt, "--json")
    assert rc == 130, err
    res = json.loads(out)                                 # exactly one JSON object on stdout
    assert res["interrupted"] is True and res["finish_reason"] == "interrupted"
    assert 1 <= len(res["output_ids"]) < 4000 and res["seed"] == 1
    assert res["text"] and res["timings"]["decode_s"] >= 0 and "Traceback" not in err


def test_ctrl_c_ends_the_text_and_prints_the_summary(ckpt):
    rc, out, err = _interrupted(ckpt)
    assert rc == 130 and out.endswith("\n"), (out[-50:], err)
    assert "(interrupted)" in err and "ms/token" in err and "Traceback" not in err


def test_help_shows_defaults():
    from dsv4.cli.chat import build_parser as chat_parser
    from dsv4.cli.decode import build_parser
    text = " ".join(build_parser().format_help().split())
    for part in ("--max-new-tokens MAX_NEW_TOKENS most tokens to generate (stops earlier at EOS) "
                 "(default: 64)", "0 = greedy (default: 0.0)", "(1 = off) (default: 1.0)",
                 "(0 = off) (default: 0)", "(default: 4096)", "(default: auto)"):
        assert part in text, part
    assert "(default: None)" not in text and "(default: False)" not in text
    chat = " ".join(chat_parser().format_help().split())
    assert "(default: 512; 16 with the demo" in chat and "(default: 8192)" in chat


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory):
    from dsv4.weights.presets import TINY_DSPARK
    from dsv4.weights.synthetic import write_checkpoint
    return write_checkpoint(TINY_DSPARK.replace(vocab_size=2048),
                            tmp_path_factory.mktemp("dspark") / "ckpt", seed=2)


def test_dspark_checkpoint_decodes_its_backbone(dspark_ckpt):
    p = run("--ckpt", str(dspark_ckpt), "--prompt-ids", "5,6,7", "--max-new-tokens", "3",
            "--json", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["output_ids"]) == 3
    assert out["seed"] is None and out["interrupted"] is False     # greedy: no seed drawn
    _check_doc_lists(out)
    notes = [ln for ln in p.stderr.splitlines() if "DSpark" in ln]
    assert len(notes) == 1 and notes[0].startswith("[dsv4] notice: DSpark checkpoint")
    for part in ("mtp.0-2", "main_proj", "markov_head", "confidence_head", "not supported yet"):
        assert part in notes[0], part
    _one_error_line(run_here("--ckpt", str(dspark_ckpt), "--prompt-ids", "5,6", "--speculative",
                             "1"),
                    "--speculative 1", "DSpark drafting is not supported yet", "--speculative 0")


def test_the_dsv4_command(capsys, tmp_path):
    from dsv4.cli.main import main
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(c in usage for c in ("decode", "chat", "serve", "bench", "make-checkpoint"))
    assert main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err
    import importlib.util
    if importlib.util.find_spec("dsv4.cli.serve") is None:        # wired at merge
        assert main(["serve"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "dsv4 serve is not available" in err
    assert main(["make-checkpoint", "--preset", "tiny", "--layers", "1", "--out",
                 str(tmp_path / "c"), "--shards", "0"]) == 0
    assert (tmp_path / "c" / "model.safetensors").is_file()
    assert main(["make-checkpoint", "--preset", "huge", "--out", str(tmp_path / "d")]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
    p = subprocess.run([sys.executable, "-m", "dsv4", "decode", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0 and "usage: dsv4 decode" in p.stdout


def _check_doc_lists(out: dict) -> None:
    """docs/CLI.md names every field of a JSON object `out` of dsv4 decode."""
    doc = (REPO / "docs" / "CLI.md").read_text()
    for key in [*out, *out["timings"], *out["memory"]]:
        assert f"`{key}`" in doc, key


def test_docs_cover_every_flag_and_the_readme_links_them():
    """docs/CLI.md names every flag of decode and chat (the JSON fields: _check_doc_lists); the
    README sends readers there (and to REAL_MODEL.md, EMBEDDING.md), not outside the repo."""
    from dsv4.cli.chat import build_parser as chat_parser
    from dsv4.cli.decode import build_parser
    doc = (REPO / "docs" / "CLI.md").read_text()
    for parser in (build_parser(), chat_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}" in doc, flag
    readme = (REPO / "README.md").read_text()
    for link in ("docs/CLI.md", "docs/REAL_MODEL.md", "docs/EMBEDDING.md"):
        assert f"]({link})" in readme and (REPO / link).is_file(), link
    assert "shared/docs" not in readme
