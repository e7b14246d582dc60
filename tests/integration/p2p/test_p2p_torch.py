"""broadcast_state_dict: a trainer's weights land in place in every worker's parameters."""

import time

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")

from tests.support.p2p_nodes import TOKEN  # noqa: E402,I001
from kvplane.common.errors import InvalidArgument  # noqa: E402
from kvplane.p2p import P2PNode  # noqa: E402
from kvplane.p2p.torch import broadcast_state_dict  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def model(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    m.register_buffer("scale", torch.full((8,), float(seed + 1), dtype=torch.bfloat16))
    return m


def test_rl_weight_update_loop_lands_in_place(tracker):
    nodes = [P2PNode(tracker=tracker.url, token=TOKEN, chunk_size=16 << 10) for _ in range(3)]
    try:
        trainer, workers = model(0), [model(1), model(2)]
        ptrs = [[p.data_ptr() for p in w.parameters()] for w in workers]
        opt = torch.optim.SGD(trainer.parameters(), lr=0.1)
        for step in (1, 2):
            loss = trainer(torch.randn(4, 64)).float().sum()
            loss.backward()
            opt.step()
            trainer.scale.mul_(1.5)
            v = broadcast_state_dict(trainer, "policy", src=True, node=nodes[0])
            assert v == step
            for w, n in zip(workers, nodes[1:]):
                assert broadcast_state_dict(w, "policy", node=n) == step
                for (k, a), b in zip(trainer.state_dict().items(), w.state_dict().values()):
                    assert torch.equal(a, b), k
        assert [[p.data_ptr() for p in w.parameters()] for w in workers] == ptrs  # in place
        # the trainer's step-1 copy was withdrawn when step 2 reused its memory; v1 is collected
        deadline = time.monotonic() + 10
        while [v["version"] for v in tracker.ls("policy")[0]["versions"]] != [2]:
            assert time.monotonic() < deadline, tracker.ls("policy")
            time.sleep(0.05)  # polling the tracker under a deadline
    finally:
        for n in nodes:
            n.close()


def test_mismatched_model_is_refused_before_any_byte_lands(tracker):
    with P2PNode(tracker=tracker.url, token=TOKEN) as pub, \
            P2PNode(tracker=tracker.url, token=TOKEN) as rx:
        broadcast_state_dict(model(0), "m", src=True, node=pub)
        other = torch.nn.Linear(64, 255)
        before = other.weight.clone()
        with pytest.raises(InvalidArgument):
            broadcast_state_dict(other, "m", node=rx)
        assert torch.equal(other.weight, before)
        with pytest.raises(InvalidArgument):
            broadcast_state_dict({"w": torch.zeros(4, 4).t()}, "x", src=True, node=pub)
