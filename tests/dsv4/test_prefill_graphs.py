"""Captured prefill chunks (dsv4/runtime/prefill_graphs.py): the piece decomposition and knobs on the CPU;
on a GPU, replay == the same pieces run eagerly, bit for bit (logits and every state row), at the
start of a sequence and continuing it, with no host sync in warm-up, capture or replay."""
import pytest
import torch

from dsv4.errors import ConfigError
from dsv4.runtime.config import RuntimeConfig
from dsv4.runtime.prefill_graphs import chunk_sizes, eager_time, pieces
from helpers import live_state, small_checkpoint


def test_pieces_cover_the_prompt_largest_first():
    assert chunk_sizes(8) == [1, 2, 4, 8] and chunk_sizes(1) == [1]
    for n in range(1, 70):
        p = pieces(n, 16)
        assert sum(p) == n and p == sorted(p, reverse=True) and all(s in chunk_sizes(16) for s in p)
        assert len(p) <= n // 16 + 4                  # full chunks, then one per set bit
    assert pieces(45, 8) == [8, 8, 8, 8, 8, 4, 1]


def test_eager_time_is_the_smallest_measured_chunk_that_holds_the_rows():
    eager = {1: 20, 2: 20, 4: 30, 8: 50}
    assert eager_time(1, eager) == 20 and eager_time(3, eager) == 30 and eager_time(8, eager) == 50
    assert eager_time(12, eager) == pytest.approx(75)             # past the largest: scaled


def _measured(replay, eager, max_rows, max_prompt=None, prefill_chunk=None):
    """A PrefillGraphs with these build-time measurements and no graphs (plan only)."""
    from dsv4.runtime.prefill_graphs import PrefillGraphs
    pg = object.__new__(PrefillGraphs)
    pg.max_rows, pg.max_prompt, pg.replay_ms, pg.eager_ms = max_rows, max_prompt, replay, eager
    pg.prefill_chunk = prefill_chunk or max_rows
    pg.chunks = dict.fromkeys(replay)
    return pg


def test_plan_replays_full_pieces_and_the_rest_where_measured_faster():
    # the H200 figures of Flash 30 layers (2026-11-25): eager ~ max(host, device)
    replay = {1: 21, 2: 36, 4: 37, 8: 38, 16: 41, 32: 46, 64: 53, 128: 57, 256: 81, 512: 122,
              1024: 150, 2048: 200, 4096: 321}
    eager = {S: 180 for S in replay} | {2048: 250, 4096: 333}
    pg = _measured(replay, eager, 4096)
    assert pg.plan(4096) == [(4096, True)] and pg.plan(16384) == [(4096, True)] * 4
    assert pg.plan(4096 + 128) == [(4096, True), (128, True)]
    assert pg.plan(4096 + 255) == [(4096, True), (255, False)]      # 8 pieces: one eager chunk
    assert pg.plan(1000, chunk=512) == [(512, True), (488, False)]
    assert pg.covers(128) and not pg.covers(255) and pg.covers(255 + 4096)
    # eager measured faster by less than EAGER_MARGIN (300 x 1.1 > 321): still the replay
    assert _measured(replay, eager | {4096: 300}, 4096).plan(4096) == [(4096, True)]
    slow = _measured(replay, eager | {4096: 280}, 4096)     # replay slower: eager pieces
    assert slow.plan(8192 + 300) == [(8192 + 300, False)]
    assert slow.plan(8192 + 128) == [(8192, False), (128, True)]
    capped = _measured(replay, eager, 4096, max_prompt=512)
    assert capped.plan(600) == [(600, False)] and capped.plan(512) == [(512, True)]
    # eager chunks of 300 rows (180 x 1.1 ms) beat their pieces (256 + 32 + 8 + 4: 202 ms), and the
    # cap-sized piece with the rest eager (81 + 180); the last 100 rows replay (136 ms)
    assert pg.plan(1000, chunk=300) == [(900, False), (64, True), (32, True), (4, True)]
    # the last 232 rows: their pieces (194 ms) against the eager chunk's 180 x 1.1
    assert pg.plan(1000, chunk=256) == [(256, True)] * 3 + [(128, True), (64, True), (32, True),
                                                            (8, True)]


def test_prefer_replay_plans_graph_pieces_whatever_the_build_measured():
    """The bench's "chunk graphs only" TTFT: with prefer = "replay" a prompt within max_prompt
    goes through its graph pieces even where the eager chunks measured faster at build (a
    tensor-parallel eager prefill's host time varies by process: the build's one timing can
    pick either)."""
    replay = {1: 5, 2: 6, 4: 8, 8: 40}
    eager = {1: 20, 2: 20, 4: 20, 8: 20}
    pg = _measured(replay, eager, 8, max_prompt=16)
    assert pg.prefer is None and pg.plan(8) == [(8, False)]
    pg.prefer = "replay"
    assert pg.plan(8) == [(8, True)] and pg.plan(13) == [(8, True), (4, True), (1, True)]
    assert pg.plan(20) == [(20, False)]                  # past max_prompt: eager still
    pg.prefer = None
    assert pg.plan(13) == [(8, False), (4, True), (1, True)]


def test_plan_weighs_pieces_against_the_eager_chunk_they_replace():
    """Issue 33: with --prefill-graphs 512, a 4,096-token prompt replayed eight 512-row graphs
    (574 ms, 20 Flash layers on an H100) where one eager 4,096-row chunk took 208 ms."""
    from dsv4.runtime.prefill_graphs import eager_sizes
    replay = {1: 20, 2: 30, 4: 31, 8: 32, 16: 34, 32: 38, 64: 43, 128: 48, 256: 56, 512: 71.7}
    eager = {S: 150 for S in replay} | {1024: 160, 2048: 180, 4096: 207.7}
    assert eager_sizes(512, 4096) == list(eager)
    pg = _measured(replay, eager, 512, prefill_chunk=4096)
    assert pg.plan(4096) == [(4096, False)]
    assert pg.plan(4096, chunk=512) == [(512, True)] * 8          # eager chunks of 512: slower
    assert pg.plan(600) == [(600, False)]             # 160 < 71.7 + 150 (512 + the rest)
    assert pg.plan(260) == [(256, True), (4, True)]             # 87 < 150
    assert pg.plan(300) == [(256, True), (32, True), (8, True), (4, True)]   # 157 < 1.1 x 150
    assert pg.plan(511) == [(511, False)]                        # nine pieces: 332 > 165
    assert eager_time(5000, eager) == pytest.approx(207.7 * 5000 / 4096)


class _Ranks:
    """Stand-in for a tensor-parallel rank's `model.tp`: its group's all_gather_object returns
    every rank's measurements (this rank's own object in its place)."""

    def __init__(self, every, rank):
        import types
        self.every, self.rank = every, rank
        gather = lambda obj: [obj if r == rank else t for r, t in enumerate(every)]  # noqa: E731
        self.comm = types.SimpleNamespace(group=types.SimpleNamespace(all_gather_object=gather))


def test_tensor_parallel_ranks_plan_the_same_pieces():
    """Each rank times its own replays, but its pieces decide the shapes and number of its
    all-reduces: ranks that planned by their own times could split a prompt differently and
    hang or mix up their collectives. agreed_ms gives every rank the slowest rank's time per
    size, so the plans are the same everywhere."""
    from dsv4.runtime.prefill_graphs import agreed_ms
    eager = {1: 20, 2: 20, 4: 20, 8: 20}
    # rank 0 replays 8 rows faster than it runs them eagerly, rank 1 does not
    replay = [{1: 5, 2: 6, 4: 8, 8: 12}, {1: 5, 2: 6, 4: 9, 8: 30}]
    own = [_measured(r, eager, 8).plan(24) for r in replay]
    assert own[0] != own[1]                     # what the ranks would do on their own
    plans = []
    for rank in (0, 1):
        pg = _measured(agreed_ms(replay[rank], _Ranks(replay, rank)),
                       agreed_ms(eager, _Ranks([eager, eager], rank)), 8)
        assert pg.replay_ms == {1: 5, 2: 6, 4: 9, 8: 30}
        plans.append(pg.plan(24))
    assert plans[0] == plans[1] == own[1]
    assert agreed_ms(replay[0], None) == replay[0]          # one process: as measured
    with pytest.raises(ConfigError, match="different chunk sizes"):
        agreed_ms(replay[0], _Ranks([replay[0], {1: 5, 2: 6}], 0))


@pytest.mark.parametrize("bad", [3, -4, 6, True, 2.0])
def test_prefill_graphs_knob_is_zero_or_a_power_of_two(bad):
    with pytest.raises(ConfigError, match="prefill_graphs"):
        RuntimeConfig(prefill_graphs=bad)
    if isinstance(bad, int) and not isinstance(bad, bool) and bad > 0:
        with pytest.raises(ConfigError, match="power of two"):
            chunk_sizes(bad)
    assert RuntimeConfig(prefill_graphs=256).prefill_graphs == 256


def test_prefill_graphs_refuse_the_cpu(tmp_path):
    from dsv4.runtime.session import load_model
    from dsv4.runtime.prefill_graphs import PrefillGraphs
    m, ck = load_model(small_checkpoint(tmp_path, "fp8"), RuntimeConfig(max_seq_len=64))
    ck.close()
    with pytest.raises(ConfigError, match="need CUDA"):
        PrefillGraphs(m, 4)


def test_a_model_whose_prefill_reads_the_host_is_refused(tmp_path):
    """A chunk is capturable only where the prefill's routed experts run on their grouped GEMM:
    their torch reference reads the routing on the host (a capture ends there). The backend's
    own decision for the shapes says where: a shard of moe_inter_dim 64 (the p1 parity
    checkpoint over two ranks) has no grouped GEMM, 256 has; capture_blocker names the device."""
    import types
    from dataclasses import replace

    from dsv4.backend.decision import Backend, _model_decisions
    from dsv4.runtime.prefill_graphs import capture_blocker
    from dsv4.runtime.session import load_model
    m, ck = load_model(small_checkpoint(tmp_path, "bf16"), RuntimeConfig(max_seq_len=64))
    ck.close()
    rows = Backend(torch.device("cuda:0"), torch.bfloat16, prefill="triton")
    assert not _model_decisions(rows, m.cfg.replace(moe_inter_dim=64)).moe_prefill
    assert _model_decisions(rows, m.cfg.replace(moe_inter_dim=256)).moe_prefill
    why = capture_blocker(m)                         # the CPU: no prefill kernels at all
    assert "cpu: the prefill kernels off" in why and "cannot be captured" in why

    def blocker(be):
        m.binding = types.SimpleNamespace(backends=lambda: {"cuda:0": be})
        return capture_blocker(m)
    assert blocker(replace(rows, moe_prefill=True)) is None
    assert "cuda:0: no grouped expert GEMM for moe_inter_dim" in blocker(rows)
    f32 = Backend(torch.device("cuda:0"), torch.float32)      # float32: the kernels are bf16
    assert "cuda:0: activations in float32" in blocker(f32)


# ---- on the GPU ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("pg"), "fp8")


def _model(ckpt, cap=512, graphs=0):
    from dsv4.runtime.session import load_model
    m, ck = load_model(ckpt, RuntimeConfig(max_seq_len=cap, devices=("cuda:0",),
                                           prefill_graphs=graphs))
    ck.close()
    return m


def _eager_pieces(m, ids, start, max_rows):
    """The same pieces through the eager chunk path (graphs detached)."""
    g, m.prefill_graphs = m.prefill_graphs, None
    try:
        pos = start
        for S in pieces(ids.shape[0], max_rows):
            out = m.prefill(ids[pos - start:pos - start + S], pos)
            pos += S
    finally:
        m.prefill_graphs = g
    return out


@pytest.mark.cuda
def test_prefill_graphs_equal_eager_bitwise_without_host_sync(ckpt):
    from dsv4.runtime.prefill_graphs import PrefillGraphs
    graphed, eager = _model(ckpt), _model(ckpt)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")           # warm-up and capture: no host sync
    try:
        graphed.prefill_graphs = PrefillGraphs(graphed, 8, max_prompt=32)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    pg = graphed.prefill_graphs
    assert pg.covers(32) and not pg.covers(33) and pg.capture_s > 0
    gen = torch.Generator().manual_seed(3)
    V = graphed.cfg.vocab_size
    # a first prompt (8+8+8+4+1 rows), then continuations at offsets that cross compressor
    # blocks (ratios 4 and 16), wrap the 16-row window ring and saturate the indexer's top-k
    for start, n in ((0, 29), (29, 6), (35, 31), (66, 32), (98, 32)):
        ids = torch.randint(0, V, (n,), generator=gen).cuda()
        if start == 0:
            graphed.reset()
        torch.cuda.set_sync_debug_mode("error")       # replay: no host sync either
        try:
            got = pg.run(ids, start)                  # the pieces, whatever covers() says
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        want = _eager_pieces(eager, ids, start, 8)
        assert torch.equal(got, want), f"logits after {start}+{n}"
        for a, b in zip(live_state(graphed), live_state(eager)):
            assert torch.equal(a, b), f"state after {start}+{n}"
    # prompts the graphs do not cover go through the eager chunks
    ids = torch.randint(0, V, (40,), generator=gen).cuda()
    assert torch.equal(graphed.prefill(ids, 0), eager.prefill(ids, 0))


@pytest.mark.cuda
def test_prefill_mixes_replayed_and_eager_pieces_as_planned(ckpt):
    """Transformer.prefill follows plan: full pieces replayed, the rest eager, pieces no longer
    than the chunk; the logits and state equal the eager chunks' bit for bit."""
    from dsv4.runtime.prefill_graphs import PrefillGraphs
    graphed, eager = _model(ckpt), _model(ckpt)
    pg = graphed.prefill_graphs = PrefillGraphs(graphed, 8)
    pg.replay_ms, pg.eager_ms = {1: 10, 2: 10, 4: 10, 8: 10}, {1: 5, 2: 5, 4: 15, 8: 15}
    assert pg.plan(21) == [(8, True), (8, True), (5, False)]
    assert pg.plan(21, 4) == [(4, True)] * 5 + [(1, False)]
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, graphed.cfg.vocab_size, (21,), generator=gen).cuda()
    for start, chunk in ((0, 8), (21, 4), (42, 16)):
        got = graphed.prefill(ids, start, chunk=chunk)
        want = eager.prefill(ids, start, chunk=min(chunk, 8))
        assert torch.equal(got, want), f"logits at {start}, chunk {chunk}"
        for a, b in zip(live_state(graphed), live_state(eager)):
            assert torch.equal(a, b), f"state at {start}, chunk {chunk}"


@pytest.mark.cuda
def test_session_with_prefill_graphs_decodes_as_without(ckpt):
    from dsv4.runtime.sampling import SamplingParams
    from dsv4.runtime.session import Session
    prompt = list(range(200, 212))                  # 8 + 4 rows through the chunk graphs
    a = Session(_model(ckpt, graphs=16), SamplingParams(), mode="graph")
    assert a.model.prefill_graphs is not None and a.model.prefill_graphs.covers(12)
    ra = a.generate(prompt, 24, keep_logits=True)
    b = Session(_model(ckpt), SamplingParams(), mode="graph")
    assert b.model.prefill_graphs is None
    b.prefill(prompt[:8])                           # the same pieces, eagerly
    rb = b.generate(prompt[8:], 24, keep_logits=True, continue_sequence=True)
    assert ra.output_ids == rb.output_ids and torch.equal(ra.logits, rb.logits)
