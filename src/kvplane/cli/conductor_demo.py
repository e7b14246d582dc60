"""``kvplane conductor demo``: play a vLLM engine for a running conductor, with no vLLM.

It registers an instance, publishes vLLM-format KV events (``BlockStored``, msgpack batches on
a ZMQ PUB socket with a replay ROUTER, as vLLM's publisher) for two prompts, and asks ``/query``
for three prompts until the answers show the cached prefixes. The conductor connects to the
demo's sockets, as to an engine registered with an ``endpoint``. The instance stays registered
(its blocks stay indexed) so that ``/query`` can be tried by hand afterwards; a second run
replaces it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import typer


@dataclass(frozen=True)
class Probe:
    """One query the demo asks, and the prefix it must answer once the events are indexed."""

    label: str
    tokens: list[int]
    expect: int


def prompts(blocks: int, block_size: int) -> tuple[list[list[int]], list[Probe]]:
    """The two prompts the engine caches, and the three probes: a cached prompt, one that shares
    its first half, one never seen."""
    n = blocks * block_size
    first, second = list(range(n)), list(range(10_000, 10_000 + n // 2))
    half = blocks // 2 * block_size
    probes = [Probe(f"prompt 1 ({n} tokens, cached)", first, n),
              Probe(f"prompt 1's first {half} tokens + {n - half} new", first[:half]
                    + list(range(20_000, 20_000 + n - half)), half),
              Probe(f"a prompt never seen ({n} tokens)", list(range(30_000, 30_000 + n)), 0)]
    return [first, second], probes


def demo(
    conductor: str = typer.Option("http://127.0.0.1:13333", help="The conductor's HTTP URL."),
    token: str = typer.Option(None, help="Token the conductor wants (default: KVPLANE_TOKEN, "
                              "else the local token file: `kvplane token --path`)."),
    model: str = typer.Option("demo-model", help="Model name the engine serves."),
    instance: str = typer.Option("demo-engine", help="Instance id it registers under."),
    block_size: int = typer.Option(16, min=1, max=4096, help="Tokens per KV block."),
    blocks: int = typer.Option(4, min=2, max=4096, help="Blocks in the first prompt."),
    timeout: float = typer.Option(10.0, min=0.1, help="Seconds to wait for the conductor."),
) -> None:
    """Play a vLLM engine for a running conductor (no vLLM needed): register, publish KV events
    for two prompts, and show POST /query answering with the cached prefix lengths."""
    import httpx

    from kvplane.cli.errors import StartFailed
    from kvplane.common.auth import client_token
    from kvplane.kvevents.publisher import KVEventPublisher

    base = conductor.rstrip("/")
    tok = client_token() if token is None else token
    cached, probes = prompts(blocks, block_size)
    headers = {"Authorization": f"Bearer {tok}"} if tok else {}
    with httpx.Client(base_url=base, headers=headers, timeout=timeout, trust_env=False) as http, \
            KVEventPublisher(host="127.0.0.1", topic=f"kv@{instance}") as pub:
        _register(http, base, (instance, model, block_size), pub, timeout)
        try:
            pub.wait_subscribed(timeout)
        except Exception as exc:
            raise StartFailed(f"the conductor at {base} did not connect to {pub.endpoint} "
                              f"within {timeout:g} s ({exc})") from exc
        count = _publish(pub, cached, block_size)
        typer.echo(f"published {count} blocks of {len(cached)} prompts as BlockStored events "
                   "(medium GPU)")
        wrong = []
        for probe in probes:
            answer = _answer(http, model, probe, timeout)
            typer.echo(f"query: {probe.label:<40} -> longest_matched {answer}")
            if answer != probe.expect:
                wrong.append(f"{probe.label}: {answer}, not {probe.expect}")
        if wrong:
            raise StartFailed(f"the conductor at {base} did not index the events within "
                              f"{timeout:g} s ({'; '.join(wrong)}); see its log")
    shown = ", ".join(map(str, probes[0].tokens[:2]))
    typer.echo(f'try it: curl -s {base}/query -H "Authorization: Bearer $(kvplane token)" '
               f"-H 'content-type: application/json' -d '{{\"model\": \"{model}\", "
               f"\"token_ids\": [{shown}, ..., {probes[0].tokens[-1]}]}}'")


def _register(http: Any, base: str, who: tuple[str, str, int], pub: Any, timeout: float) -> None:
    """(Re)register the demo instance ``who`` (instance, model, block size) with the
    publisher's endpoints, waiting up to ``timeout`` for the conductor to listen."""
    import httpx

    from kvplane.cli.errors import StartFailed
    from kvplane.common.deadline import Deadline

    instance, model, block_size = who
    body = {"instance_id": instance, "modelname": model, "block_size": block_size,
            "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
            "hash_profile": {"algorithm": "sha256", "python_hash_seed": "0"}}
    deadline = Deadline.after(timeout)
    while True:  # a conductor started a moment ago (`kvplane conductor &`) may not listen yet
        try:
            http.post("/unregister", json={"instance_id": instance})  # a previous run's, if any
            r = http.post("/register", json=body)
            break
        except httpx.TransportError as exc:
            if deadline.expired():
                raise StartFailed(f"no conductor answers at {base} ({type(exc).__name__}); start "
                                  "one (kvplane conductor) or pass its URL with --conductor") from exc
            time.sleep(0.1)  # retried until the --timeout deadline
    if r.status_code in (401, 403):
        raise StartFailed(f"the conductor at {base} refused the token ({r.status_code}); pass "
                          "its token with --token or KVPLANE_TOKEN")
    if r.status_code != 200:
        raise StartFailed(f"the conductor at {base} refused the registration "
                          f"({r.status_code}: {r.text[:200]})")
    typer.echo(f"{instance} registered with {base} (model {model}, block size {block_size}); "
               f"its KV events: {pub.endpoint}")


def _publish(pub: Any, cached: list[list[int]], block_size: int) -> int:
    """One BlockStored batch per prompt, hashed as vLLM hashes (sha256, PYTHONHASHSEED=0)."""
    from kvplane.conductor.hashing import HashProfile
    from kvplane.kvevents.codec import stored

    profile, count = HashProfile("sha256", "0"), 0
    for tokens in cached:
        hashes = list(profile.event_hashes(tokens, block_size))
        pub.publish([stored(hashes, tokens[:len(hashes) * block_size], block_size)])
        count += len(hashes)
    return count


def _answer(http: Any, model: str, probe: Probe, timeout: float) -> int:
    """The probe's longest match, asked again until it is the expected one or time is up."""
    from kvplane.cli.errors import StartFailed
    from kvplane.common.deadline import Deadline

    deadline, got = Deadline.after(timeout), -1
    while True:
        r = http.post("/query", json={"model": model, "token_ids": probe.tokens})
        if r.status_code != 200:
            raise StartFailed(f"/query answered {r.status_code}: {r.text[:200]}")
        got = max((inst.get("longest_matched", 0) for tenant in r.json().values()
                   for inst in tenant.values()), default=0)
        if got == probe.expect or deadline.expired():
            return int(got)
        time.sleep(0.05)  # the conductor indexes the events on its own thread: ask again
