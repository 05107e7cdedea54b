"""The host rule that picks speculative or plain steps (dsv4/runtime/speculative/policy.py): it backs off while
drafts fail, doubling the plain run up to its cap, keeps drafting while they pass, and decides from
accepted counts alone."""
import pytest

from dsv4.errors import InputError
from dsv4.runtime.speculative.policy import SpecPolicy


def _run(policy, accept, n):
    """n steps; accept(i) -> whether the i-th speculative step's draft is accepted. -> 'S'/'P'."""
    out, k = [], 0
    for _ in range(n):
        if policy.speculate():
            policy.spec_step(int(accept(k)), 1)
            k += 1
            out.append("S")
        else:
            policy.plain_step()
            out.append("P")
    return "".join(out)


def test_failing_drafts_back_off_doubling_to_the_cap():
    seq = _run(SpecPolicy(0.7, probe=4, window=16, backoff=16, max_backoff=64), lambda i: 0, 240)
    runs = seq.split("S")
    plain_runs = [len(r) for r in runs if r]
    assert seq.startswith("SSSS" + "P" * 16 + "SSSS" + "P" * 32 + "SSSS")
    assert plain_runs[:4] == [16, 32, 64, 64]


def test_passing_drafts_never_stop_and_reset_the_backoff():
    p = SpecPolicy(0.7)
    assert _run(p, lambda i: 1, 200) == "S" * 200
    # one failed probe, then a window of good drafts: the next failure backs off from 4 again
    p = SpecPolicy(0.7, probe=4, window=8, backoff=4, max_backoff=64)
    pattern = [0] * 4 + [1] * 12 + [0] * 8
    seq = _run(p, lambda i: pattern[i] if i < len(pattern) else 0, 48)
    # probe fails -> 4 plain; the probe passes, a window of 8 good ones passes (back-off 4 again);
    # the next window (4 good, 4 rejected: 0.5) fails -> 4 plain, not 8; the probe fails -> 8
    assert seq.startswith("SSSS" + "PPPP" + "S" * 20 + "PPPP" + "SSSS" + "P" * 8)


def test_windows_do_not_overlap():
    # every window 3 of 4 (0.75): [0, 1, 1, 1] then [1, 1, 1, 0], alternately, so that four steps
    # across a boundary (1, 0, 0, 1) hold 0.5, which a sliding window would judge
    alternate = lambda i: ([0, 1, 1, 1], [1, 1, 1, 0])[(i // 4) % 2][i % 4]   # noqa: E731
    assert _run(SpecPolicy(0.7, probe=4, window=4), alternate, 60) == "S" * 60


def test_threshold_and_always():
    # 3 of 4 accepted (0.75) passes a bar of 0.7 and fails one of 0.8
    good = lambda i: i % 4 != 0                           # noqa: E731
    assert "P" not in _run(SpecPolicy(0.7), good, 100)
    assert "P" in _run(SpecPolicy(0.8), good, 100)
    assert _run(SpecPolicy(0.0), lambda i: 0, 100) == "S" * 100
    p = SpecPolicy(0.7)
    _run(p, lambda i: 0, 10)
    assert not p.speculate()
    p.reset()
    assert p.speculate()


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_bad_min_acceptance(bad):
    with pytest.raises(InputError, match="spec_min_acceptance = "):
        SpecPolicy(bad)
