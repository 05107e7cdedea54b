"""dsv4.errors: the CLI's wording of API errors, and exit codes."""
import pytest

from dsv4.errors import CapacityError, DeviceError, InputError, exit_code, in_cli_words


@pytest.mark.parametrize("api, cli", [
    ("raise RuntimeConfig.max_seq_len to at least 303 or lower max_new_tokens",
     "raise --max-seq-len to at least 303 or lower --max-new-tokens"),
    ("mode='graph' needs CUDA; use mode='eager' or mode='auto'",
     "--mode graph needs CUDA; use --mode eager or --mode auto"),
    ("spec_min_acceptance = 1.5: must be in [0, 1]", "--speculative-min-acceptance 1.5: must be in [0, 1]"),
    ("speculative = 3: only 1 draft token", "--speculative 3: only 1 draft token"),
    ("prefill_chunk = 0; expected a positive integer", "--prefill-chunk 0; expected a positive integer"),
    # prose and other names stay
    ("graph mode needs CUDA, speculative decoding", "graph mode needs CUDA, speculative decoding"),
    ("thinking_mode='x'; expected 'chat'", "thinking_mode='x'; expected 'chat'"),
])
def test_in_cli_words(api, cli):
    assert in_cli_words(api) == cli


def test_exit_code_words_and_statuses(capsys):
    def capacity():
        raise CapacityError("raise RuntimeConfig.max_seq_len to at least 9")
    assert exit_code(capacity) == 2
    assert capsys.readouterr().err == "error: raise --max-seq-len to at least 9\n"
    assert exit_code(lambda: (_ for _ in ()).throw(DeviceError("mode='graph' needs CUDA"))) == 2
    assert "--mode graph needs CUDA" in capsys.readouterr().err
    assert exit_code(lambda: (_ for _ in ()).throw(KeyboardInterrupt())) == 130
    assert exit_code(lambda: (_ for _ in ()).throw(RuntimeError("boom"))) == 1
    assert "runtime error: RuntimeError: boom" in capsys.readouterr().err
    assert exit_code(lambda: 0) == 0 and exit_code(lambda: None) == 0
    assert issubclass(CapacityError, InputError)
