"""DDP on 4 kvplane ranks survives a killed or stopped rank 2, and a replacement rejoins.

The victim kills (or stops) itself at a fixed step, so the failure point is deterministic. Every
survivor must finish every step; each op from the failure on must complete within its deadline
with rank 2 in ``failed_ranks_hint``; the loss must keep falling; after ``sync_after_failure``
``active_ranks`` shows the hole, and after the replacement joins all four ranks train together
with identical parameters.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kvplane.collectives as kc
from tests.support.ranks import RankContext, RankGroup

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]

VICTIM, FAIL_AT, STEPS, AFTER_JOIN = 2, 4, 12, 4
TIMEOUT = 10.0  # per-op deadline; ops over live ranks must not time out on a loaded box
# heartbeat_timeout leaves room for a loaded box: a rank silent this long is declared dead, and
# DDP setup over a group that lost a live rank fails ("inconsistent 0 params")
OPTS = dict(timeout=TIMEOUT, heartbeat_interval=0.1, heartbeat_timeout=3.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 8, generator=g)
    w = torch.linspace(-1, 1, 8).unsqueeze(1)
    return x, torch.sin(x @ w)


def _train(ddp: torch.nn.Module, state: SimpleNamespace, opt: torch.optim.Optimizer, rank: int,
           steps: range, sig: int | None) -> list[dict[str, object]]:
    x, y = _data(rank)
    log = []
    for step in steps:
        if sig is not None and rank == VICTIM and step == FAIL_AT:
            os.kill(os.getpid(), sig)
        state.works = []
        t0 = time.monotonic()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append({"step": step, "loss": loss.item(), "seconds": time.monotonic() - t0,
                    "success": [w.local_success for w in state.works],
                    "hint": [w.failed_ranks_hint.tolist() for w in state.works]})
    return log


def _fingerprint(model: torch.nn.Module) -> list[float]:
    return [p.detach().double().sum().item() for p in model.parameters()]


def _survivor(ctx: RankContext, sig: int, rejoin: bool) -> dict[str, object]:
    dist.init_process_group("kvplane", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            pg_options=kc.KvplaneOptions(**OPTS))
    model = _model()
    ddp = DDP(model)
    state = SimpleNamespace(works=[])
    ddp.register_comm_hook(state, kc.elastic_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    out: dict[str, object] = {"log": _train(ddp, state, opt, ctx.rank, range(STEPS), sig)}
    out["sync"] = kc.sync_after_failure(timeout=TIMEOUT)
    out["active_after_sync"] = kc.get_active_ranks().tolist()
    out["epoch_after_sync"] = kc.get_current_epoch()
    if not rejoin:
        return out
    ctx.report("ready")
    assert ctx.command(30.0) == "activate"
    kc.activate_ranks([VICTIM], timeout=TIMEOUT)
    out["active_after_join"] = kc.get_active_ranks().tolist()
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    ddp2 = DDP(fresh)  # rebuilt over the whole world: broadcasts rank 0's parameters
    ddp2.register_comm_hook(state, kc.elastic_allreduce_hook)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.2)
    out["log_joined"] = _train(ddp2, state, opt2, ctx.rank, range(STEPS, STEPS + AFTER_JOIN), None)
    out["params"] = _fingerprint(fresh)
    return out


def _replacement(ctx: RankContext) -> dict[str, object]:
    dist.init_process_group("kvplane", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size,
                            pg_options=kc.KvplaneOptions(is_extension=True, **OPTS))
    ctx.report("posted")  # the join request is in the store once init returns
    t0 = time.monotonic()
    kc.join_group(timeout=20.0)
    joined = time.monotonic() - t0
    model = _model()
    ddp = DDP(model)
    state = SimpleNamespace(works=[])
    ddp.register_comm_hook(state, kc.elastic_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    log = _train(ddp, state, opt, ctx.rank, range(STEPS, STEPS + AFTER_JOIN), None)
    return {"join_s": joined, "log_joined": log, "params": _fingerprint(model),
            "active": kc.get_active_ranks().tolist()}


def _check_survivors(res: dict[int, dict[str, object]]) -> None:
    for r in (0, 1, 3):
        log = res[r]["log"]
        assert [e["step"] for e in log] == list(range(STEPS)), f"rank {r} did not finish every step"
        for e in log[:FAIL_AT]:
            assert all(e["success"]) and e["success"], (r, e)
        for e in log[FAIL_AT:]:
            assert e["success"] and not any(e["success"]), (r, e)
            assert all(h[VICTIM] == 1 and sum(h) == 1 for h in e["hint"]), (r, e)
            assert e["seconds"] < TIMEOUT, f"rank {r} step {e['step']} took {e['seconds']:.2f}s"
        losses = [e["loss"] for e in log]
        assert losses[-1] < losses[FAIL_AT - 1] < losses[0], (r, losses)
        assert all(b <= a * 1.02 for a, b in zip(losses[FAIL_AT:], losses[FAIL_AT + 1:])), (r, losses)
        assert res[r]["sync"] == "Reconciled"
        assert res[r]["active_after_sync"] == [1, 1, 0, 1]


def test_ddp_survives_kill_and_replacement_rejoins() -> None:
    with RankGroup(4) as g:
        g.start(_survivor, signal.SIGKILL, True)
        for r in (0, 1, 3):
            g.wait_event(r, "ready", 60.0)
        g.start(_replacement, ranks=[VICTIM])
        g.wait_event(VICTIM, "posted", 30.0)
        for r in (0, 1, 3):
            g.send(r, "activate")
        res = g.wait_results([0, 1, 2, 3], 60.0)
    _check_survivors(res)
    for r in (0, 1, 3):
        assert res[r]["active_after_join"] == [1, 1, 1, 1]
    assert res[VICTIM]["active"] == [1, 1, 1, 1]
    for r in range(4):
        for e in res[r]["log_joined"]:
            assert e["success"] and all(e["success"]), (r, e)
            assert all(sum(h) == 0 for h in e["hint"])
    assert len({tuple(res[r]["params"]) for r in range(4)}) == 1, "parameters diverged after the join"


def test_ddp_survives_sigstop() -> None:
    with RankGroup(4) as g:
        g.start(_survivor, signal.SIGSTOP, False)
        res = g.wait_results([0, 1, 3], 90.0)
    _check_survivors(res)
    first = [res[r]["log"][FAIL_AT]["seconds"] for r in (0, 1, 3)]
    # a stopped rank is found by the missing heartbeats, well before the op deadline
    assert max(first) < TIMEOUT
