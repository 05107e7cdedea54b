"""`--ckpt owner/name`: a Hugging Face repo id resolved through huggingface_hub (dsv4.weights.hub)
from a Hugging Face cache the test writes (offline), and the errors of a repo that is not cached,
only partly cached, not a DeepSeek-V4 checkpoint, or out of reach."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from argparse import Namespace

import pytest

from conftest import REPO
from helpers import small_checkpoint

pytest.importorskip("huggingface_hub", reason="--ckpt owner/name needs huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache(home, repo: str, files: dict) -> "Path":
    """The layout huggingface_hub keeps under HF_HOME: hub/models--owner--name/{blobs, refs/main,
    snapshots/<commit>/<file> -> ../../blobs/<file's blob>}; files: name -> source path or bytes.
    -> the snapshot folder."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    for i, (name, src) in enumerate(files.items()):
        blob = root / "blobs" / f"{i:040x}"
        if isinstance(src, bytes):
            blob.write_bytes(src)
        else:
            shutil.copyfile(src, blob)
        (snap / name).symlink_to(f"../../blobs/{blob.name}")
    return snap


def dsv4(*args, env=None, prelude: str = ""):
    """`dsv4 ...` in a subprocess with only `env` added (HF_HOME, HF_HUB_OFFLINE, ...)."""
    import os
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(env or {})
    code = f"import sys; {prelude}from dsv4.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, env=e, cwd=REPO)


def dsv4_here(*args):
    """The same command's main in this process (its exit status and what it prints), where no
    HF_* variable is involved (huggingface_hub reads them when it is imported)."""
    from dsv4.cli.main import main
    from helpers import run_main
    return run_main(main, args, ["dsv4"])


def error_line(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("hub"), "fp8")


def test_a_repo_id_decodes_from_the_cache_offline(ckpt, tmp_path):
    home = tmp_path / "hf"
    hf_cache(home, "acme/tiny-v4", {f.name: f for f in ckpt.iterdir()})
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    args = ("--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json", "--device", "cpu")
    by_id = dsv4("decode", "--ckpt", "acme/tiny-v4", *args, env=env)
    assert by_id.returncode == 0, by_id.stderr
    by_dir = dsv4_here("decode", "--ckpt", str(ckpt), *args)     # the reference: a folder
    assert json.loads(by_id.stdout)["output_ids"] == json.loads(by_dir.stdout)["output_ids"]


def test_the_server_and_chat_name_the_repo_not_its_snapshot(ckpt):
    from dsv4.cli.options import model_name
    snap = ckpt.parent / COMMIT          # what the cache hands back: a folder named by a commit
    assert model_name(Namespace(ckpt="acme/tiny-v4", demo=False), snap) == "acme/tiny-v4"
    assert model_name(Namespace(ckpt=str(ckpt), demo=False), ckpt) == ckpt.name


def test_not_in_the_cache_offline_says_how_to_download(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    line = error_line(dsv4("decode", "--ckpt", "acme/missing", "--prompt-ids", "1", env=env))
    for part in ("acme/missing", "not in the Hugging Face cache", str(tmp_path / "hf"),
                 "HF_HUB_OFFLINE", "hf download acme/missing"):
        assert part in line, (part, line)


def test_a_partial_cache_offline_names_the_missing_shard(ckpt, tmp_path):
    home = tmp_path / "hf"
    hf_cache(home, "acme/half", {f.name: f for f in ckpt.iterdir()
                                 if f.name != "model-00002-of-00002.safetensors"})
    line = error_line(dsv4("chat", "--ckpt", "acme/half",
                           env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}))
    assert "model-00002-of-00002.safetensors" in line and "only part of it" in line, line


def test_a_repo_that_is_not_dsv4_is_refused(tmp_path):
    home = tmp_path / "hf"
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
    hf_cache(home, "acme/llama", {"config.json": json.dumps(cfg).encode(),
                                  "model.safetensors": b"\0" * 16})
    line = error_line(dsv4("decode", "--ckpt", "acme/llama", "--prompt-ids", "1",
                           env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}))
    assert "acme/llama is not a DeepSeek-V4 checkpoint" in line and "'llama'" in line, line


def test_no_network_says_so(tmp_path):
    """A repo not cached and a Hub that cannot be reached (a closed local port; the client's
    retry pauses skipped)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed once the block ends: connections refused
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    line = error_line(dsv4("decode", "--ckpt", "acme/far", "--prompt-ids", "1", env=env,
                           prelude="import time; time.sleep = lambda s: None; "))
    for part in ("acme/far", f"could not reach http://127.0.0.1:{port}", "not in the Hugging "
                 "Face cache", "hf download acme/far"):
        assert part in line, (part, line)


def test_what_reads_as_a_repo_id():
    from dsv4.weights.hub import looks_like_repo_id
    for ref in ("deepseek-ai/DeepSeek-V4-Flash", "acme/tiny_v4.1"):
        assert looks_like_repo_id(ref), ref
    for ref in ("/models/flash", "./flash", "flash", "a/b/c", "../x", "a/..", "~/models/x"):
        assert not looks_like_repo_id(ref), ref


def test_a_missing_folder_that_is_no_repo_id(tmp_path):
    line = error_line(dsv4_here("decode", "--ckpt", str(tmp_path / "none"), "--prompt-ids", "1"))
    assert str(tmp_path / "none") in line and "Hugging Face repo id" in line, line
