"""kvplane.bench.multiturn: the workload, the scheduling rules and the per-round summaries.

A fake OpenAI server runs in process (an httpx MockTransport passed to the driver): it streams
SSE like vLLM, reports ``cached_tokens`` from a prefix cache of its own, and records when each
request started and ended, so the tests can check the round barrier, max_parallel and the queue.
"""

import asyncio
import json
import math

import httpx
import pytest

from kvplane.bench import multiturn_report as report
from kvplane.bench.multiturn import Endpoint, MultiturnConfig, Workload, run_async
from kvplane.common.errors import InvalidArgument
from kvplane.conductor.scheduling.trace import parse_lines, turns

pytestmark = pytest.mark.timeout(30)
BS = 8


class FakeServer:
    """Streams ``max_tokens`` tokens; cached = longest earlier prompt's shared full blocks."""

    def __init__(self, delay=lambda prompt: 0.0, fail=lambda n: False, usage=True):
        self.delay, self.fail, self.usage = delay, fail, usage
        self.seen: list[list[int]] = []
        self.events: list[tuple[str, int, list[int]]] = []  # (start|end, seq, prompt)
        self.inflight = self.peak = self.n = 0

    def cached(self, prompt):
        best = 0
        for old in self.seen:
            k = 0
            while k < min(len(old), len(prompt)) and old[k] == prompt[k]:
                k += 1
            best = max(best, k // BS * BS)
        return min(best, (len(prompt) - 1) // BS * BS)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        body = json.loads(request.content)
        prompt, seq = body["prompt"], self.n
        self.n += 1
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        self.events.append(("start", seq, prompt))
        try:
            await asyncio.sleep(self.delay(prompt))
            if self.fail(seq):
                return httpx.Response(500, text="scripted")
            cached = self.cached(prompt)
            self.seen.append(prompt)
            out = [(sum(prompt) + i) % 97 + 3 for i in range(body["max_tokens"])]
            chunks = [{"choices": [{"index": 0, "text": f" t{t}", "token_ids": [t]}]} for t in out]
            if self.usage:
                chunks.append({"choices": [], "usage": {
                    "prompt_tokens": len(prompt), "completion_tokens": len(out),
                    "prompt_tokens_details": {"cached_tokens": cached}}})
            sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, content=sse.encode(), headers={"x-kvplane-backend": "b0"})
        finally:
            self.inflight -= 1
            self.events.append(("end", seq, prompt))


def drive(cfg, server):
    return asyncio.run(run_async(cfg, Endpoint("http://fake"), transport=httpx.MockTransport(server)))


def small(**kw):
    base = dict(clients=3, rounds=4, request_length=20, output_length=4, max_parallel=2, seed=1,
                vocab=200)
    return MultiturnConfig(**{**base, **kw})


def test_each_turn_extends_the_previous_one_by_answer_and_question():
    cfg = small(sub_question_length=10, shared_prefix=6)
    server = FakeServer()
    recs = drive(cfg, server)
    assert len(recs) == cfg.clients * cfg.rounds and not any(r.error for r in recs)
    by_client: dict[int, list] = {}
    for kind, _seq, prompt in server.events:
        if kind == "start":
            by_client.setdefault(tuple(prompt[6:26]), []).append(prompt)
    assert len(by_client) == cfg.clients  # each conversation keeps its own first question
    shared = {tuple(p[:6]) for ps in by_client.values() for p in ps}
    assert len(shared) == 1  # the shared prefix is common to all
    for prompts in by_client.values():
        assert [len(p) for p in prompts] == [cfg.prompt_tokens(r) for r in range(1, cfg.rounds + 1)]
        for prev, cur in zip(prompts, prompts[1:]):
            answer = [(sum(prev) + i) % 97 + 3 for i in range(cfg.output_length)]
            assert cur[:len(prev)] == prev and cur[len(prev):len(prev) + 4] == answer


@pytest.mark.parametrize("barrier", [True, False])
def test_round_barrier_holds_the_next_round_until_every_client_finished(barrier):
    # client 0 is fast, the others slow: without a barrier it runs ahead
    cfg = small(round_barrier=barrier, max_parallel=3, rounds=3)
    fast = None

    def delay(prompt):
        nonlocal fast
        fast = fast or tuple(prompt[:20])
        return 0.0 if tuple(prompt[:20]) == fast else 0.02

    server = FakeServer(delay)
    recs = drive(cfg, server)
    rounds_started = [len(p) for k, _s, p in server.events if k == "start"]
    ended: dict[int, int] = {}
    ahead = False
    for kind, _seq, prompt in server.events:
        rnd = [cfg.prompt_tokens(r) for r in range(1, 4)].index(len(prompt)) + 1
        if kind == "end":
            ended[rnd] = ended.get(rnd, 0) + 1
        elif rnd > 1 and ended.get(rnd - 1, 0) < cfg.clients:
            ahead = True
    assert len(rounds_started) == len(recs) == 9
    assert ahead is not barrier


def test_max_parallel_bounds_requests_in_flight():
    server = FakeServer(lambda p: 0.005)
    drive(small(max_parallel=2, clients=5, round_barrier=False), server)
    assert server.peak == 2


def test_random_ready_queue_is_seeded():
    def order(seed, policy):
        server = FakeServer()
        drive(small(queue_policy=policy, seed=seed, max_parallel=1, clients=5, rounds=2), server)
        return [tuple(p[:20]) for k, _s, p in server.events if k == "start"]

    assert order(3, "random") == order(3, "random")
    assert order(3, "random") != order(4, "random")
    fifo = order(3, "fifo")
    assert fifo[:5] == fifo[5:]  # FIFO with a barrier: the same client order every round


def test_request_rate_spaces_the_sends():
    server = FakeServer()
    recs = drive(small(request_rate=50.0, distribution="uniform", clients=4, rounds=2,
                       max_parallel=4), server)
    starts = sorted(r.start_s for r in recs)
    assert starts[-1] >= 0.02  # 7 gaps of mean 20 ms; with rate inf they all start at once
    fast = drive(small(clients=4, rounds=1, max_parallel=4), FakeServer())
    assert max(r.start_s for r in fast) < starts[-1]


def test_cached_tokens_ttft_and_hit_rate_by_round():
    cfg = small(clients=2, rounds=3)
    recs = drive(cfg, FakeServer())
    stats = report.by_round(recs)
    assert [s.round for s in stats] == [1, 2, 3]
    assert stats[0].hit_rate == 0.0
    r2 = [r for r in recs if r.round == 2]
    assert all(r.cached_tokens == (cfg.prompt_tokens(1)) // BS * BS for r in r2)
    assert stats[1].hit_rate == pytest.approx(sum(r.cached_tokens for r in r2)
                                              / sum(r.prompt_tokens for r in r2))
    assert all(r.ttft_s is not None and r.latency_s >= r.ttft_s and r.output_tokens == 4
               and r.backend == "b0" for r in recs)
    text = report.table({"fake": stats})
    assert "| fake | 2 | 2 | 0 |" in text and "0.0%" in text
    compact = report.compact_table({"fake": stats}).splitlines()
    assert compact[0] == "| row | r1 | r2 | r3 |" and compact[2].startswith("| fake | 0.0% / ")


def test_no_usage_means_unknown_hit_rate_not_zero():
    recs = drive(small(clients=2, rounds=2), FakeServer(usage=False))
    assert all(r.cached_tokens is None for r in recs)
    assert all(s.hit_rate is None for s in report.by_round(recs))


def test_a_failed_request_is_recorded_and_its_conversation_goes_on():
    server = FakeServer(fail=lambda seq: seq == 1)
    recs = drive(small(), server)
    bad = [r for r in recs if r.error]
    assert len(bad) == 1 and "HTTP 500" in bad[0].error and bad[0].round == 1
    assert len(recs) == 12
    stats = report.by_round(recs)
    assert stats[0].failed == 1 and stats[0].requests == 3


def test_hash_ids_name_prefixes_and_the_trace_replays_as_turns():
    cfg = small(clients=2, rounds=3, trace_block=BS)
    w = Workload(cfg)
    a, b = [1] * 20 + [2] * 5, [1] * 20 + [3] * 5
    ha, hb = w.hash_ids(a), w.hash_ids(b)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]  # two full blocks shared, partial tails distinct
    recs = drive(cfg, FakeServer())
    trace = parse_lines(report.trace_lines(recs))
    by_turn = turns(trace, block_tokens=cfg.trace_block)
    assert sorted(by_turn.values()) == [1, 1, 2, 2, 3, 3]


def test_bad_configs_are_refused():
    for kw in ({"clients": 0}, {"request_rate": 0}, {"queue_policy": "lifo"}, {"first_token": 5000}):
        with pytest.raises(InvalidArgument):
            small(**kw)
    assert math.isinf(MultiturnConfig().request_rate)


def test_working_set_counts_the_shared_prefix_once():
    cfg = small(shared_prefix=10, clients=4, rounds=2)
    own = cfg.prompt_tokens(2) - 10 + cfg.output_length
    assert cfg.working_set_tokens(2) == 10 + 4 * own


def test_plots_and_files(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = small(clients=2, rounds=2)
    recs = drive(cfg, FakeServer())
    rows = {"a": recs, "b": recs}
    stats = {k: report.by_round(v) for k, v in rows.items()}
    png = report.plot_rounds(stats, tmp_path / "r.png", "t", {"sim": {1: 0.0, 2: 0.5}})
    assert png.stat().st_size > 10_000
    doc = json.loads(report.write_json(rows, tmp_path / "m.json", {"x": 1}).read_text())
    assert doc["x"] == 1 and doc["rows"]["a"]["rounds"][1]["round"] == 2
    assert report.write_csv(rows, tmp_path / "m.csv").read_text().count("\n") == 1 + 2 * len(recs)
    pts = [report.crossover_point("L2", n, n * 1.0, recs) for n in (1, 2, 3)]
    assert pts[0].hit_rate is not None and pts[0].hit_rate > 0
    assert report.plot_crossover(pts, 2.0, tmp_path / "c.png").stat().st_size > 10_000


def test_interleaved_rows_alternate_round_by_round():
    from kvplane.bench.multiturn import run_interleaved_async

    cfg = small(clients=2, rounds=3)
    log: list[tuple[str, int]] = []

    class Logged(FakeServer):
        def __init__(self, name):
            super().__init__(lambda p: 0.002)
            self.name = name

        async def __call__(self, request):
            resp = await super().__call__(request)
            if request.url.path == "/v1/completions":
                prompt = json.loads(request.content)["prompt"]
                log.append((self.name, [cfg.prompt_tokens(r) for r in (1, 2, 3)].index(len(prompt)) + 1))
            return resp

    servers = {"a": Logged("a"), "b": Logged("b")}
    eps = {k: Endpoint("http://fake") for k in servers}
    out = asyncio.run(run_interleaved_async(cfg, eps, transports={
        k: httpx.MockTransport(s) for k, s in servers.items()}))
    assert {k: len(v) for k, v in out.items()} == {"a": 6, "b": 6}
    assert [row for row, _r in log] == ["a", "a", "b", "b"] * 3
    assert [r for _row, r in log] == [1] * 4 + [2] * 4 + [3] * 4
    with pytest.raises(InvalidArgument):
        asyncio.run(run_interleaved_async(small(round_barrier=False), eps))


def test_runs_combine_pooled_per_round_with_each_runs_spread_and_the_baseline_ratio(tmp_path):
    from kvplane.bench.multiturn import RequestRecord as R

    def run(scale):  # 2 rows x 2 rounds x 2 requests; TTFTs known
        return {"A": [R(c, rnd, 100, 50 * (rnd - 1), ttft_s=scale * (0.1 * rnd + 0.01 * c))
                      for rnd in (1, 2) for c in (0, 1)],
                "B": [R(c, rnd, 100, 0, ttft_s=scale * 0.4) for rnd in (1, 2) for c in (0, 1)]}
    for i, scale in enumerate((1.0, 3.0)):
        report.emit(run(scale), tmp_path / f"r{i}", {}, plots=False)
    runs = report.load_runs([tmp_path / "r0", tmp_path / "r1" / "multiturn.json"])
    assert [sorted(r) for r in runs] == [["A", "B"], ["A", "B"]]
    text = report.combined(runs, baseline="B")
    lines = text.splitlines()
    # pooled A: round 1 0.10, 0.11, 0.30, 0.33 s -> p50 0.205; round 2 0.20, 0.21, 0.60,
    # 0.63 -> 0.405; hit rate 0 then 50 %
    assert "| A | 2 | 0.0% / 205 | 50.0% / 405 |" in lines
    # the median of the runs' own p50s (105 and 315 ms; 205 and 615) with their range
    assert "| A | 2 | 210 (105-315) | 410 (205-615) |" in lines
    # pooled B p50 = (0.4 + 1.2) / 2 = 0.8 s: A / B per round
    assert lines[-1] == "| A | 2 | 0.26 | 0.51 |"
    assert "over B's" in text and "TTFT p50 over" not in report.combined(runs, baseline="C")
