"""Multi-turn conversations: hit rate and TTFT by round, per cache setup ("row"), in one run.

Two ways to run it:

* ``--url URL`` (repeatable, with ``--label``): drive OpenAI-compatible servers that are already
  running, one row each (vLLM needs ``--enable-prompt-tokens-details`` for the cached tokens).
* ``--rows L1,L2,kvplane,mooncake,kvplane-ssd`` (the default): start every row's engines on this
  host with real vLLM CPU (the venv at KVPLANE_VLLM_PYTHON), one row after the other (a row's
  engines stop before the next row's start), the same workload each time
  (tests/support/multiturn_stack.py says what each row runs).
  ``--sweep 2,4,...`` adds the crossover sweep (conversation count grown past the L2 capacity)
  and ``--simulate`` puts ``kvplane simulate``'s prediction on the benchmark's own trace beside
  the measurement.

Prints the per-round table of every row first, then writes ``multiturn.json``, ``multiturn.csv``,
``multiturn_rounds.png`` (two panels: hit rate by round, TTFT p50/p90 by round) and, with
``--sweep``, ``multiturn_crossover.png`` into ``--out``. A progress bar per row goes to stderr.

Usage: python benchmarks/multiturn.py [--rows ...] [--clients 8] [--rounds 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from kvplane.bench import multiturn_report as report
from kvplane.bench.multiturn import Endpoint, MultiturnConfig, RequestRecord, run_interleaved


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    w = ap.add_argument_group("workload (SGLang bench_multiturn / LMCache multi-round-qa)")
    w.add_argument("--clients", type=int, default=8, help="concurrent conversations")
    w.add_argument("--rounds", type=int, default=10, help="turns per conversation")
    w.add_argument("--request-length", type=int, default=192, help="tokens of the first question")
    w.add_argument("--sub-question-length", type=int, default=0,
                   help="tokens of each follow-up question (0: --request-length)")
    w.add_argument("--output-length", type=int, default=16, help="tokens generated per turn")
    w.add_argument("--shared-prefix", type=int, default=0, help="system prompt shared by all")
    w.add_argument("--max-parallel", type=int, default=2, help="most requests in flight")
    w.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: no gap)")
    w.add_argument("--distribution", choices=["poisson", "uniform"], default="poisson")
    w.add_argument("--no-round-barrier", dest="round_barrier", action="store_false",
                   help="let a conversation start its next round before the others finish theirs")
    w.add_argument("--ready-queue", choices=["fifo", "random"], default="fifo")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    w.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    t = ap.add_argument_group("targets")
    t.add_argument("--url", action="append", default=[],
                   help="a running server (one row each; several are interleaved round by round)")
    t.add_argument("--label", action="append", default=[], help="row name for each --url")
    t.add_argument("--model", default="", help="served model name ('' asks /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    t.add_argument("--rows", default="L1,L2,kvplane,mooncake,kvplane-ssd",
                   help="live rows to start when no --url is given, run one after the other "
                   "(each row's engines stop before the next row's start)")
    t.add_argument("--sweep", default="", help="crossover sweep: conversation counts, e.g. 2,3,4,8,10,12")
    t.add_argument("--sweep-rows", default="L2,kvplane", help="rows of the crossover sweep")
    t.add_argument("--sweep-rounds", type=int, default=4, help="rounds per sweep run")
    t.add_argument("--simulate", action="store_true", help="kvplane simulate on the trace, beside")
    t.add_argument("--stack-json", default="", help="JSON overrides of the live stack's sizes")
    ap.add_argument("--out", default="multiturn-out", help="directory for JSON, CSV, PNGs, logs")
    ap.add_argument("--combine", nargs="+", default=[], metavar="OUT",
                    help="run nothing: pool the multiturn.json of earlier runs of one workload "
                    "(their --out directories) and print per-round tables over all of them")
    ap.add_argument("--baseline", default="+Mooncake L3",
                    help="with --combine: the row the others' TTFT is divided by")
    ap.add_argument("--no-plots", action="store_true")
    return ap.parse_args(argv)


def config(args: argparse.Namespace) -> MultiturnConfig:
    return MultiturnConfig(
        clients=args.clients, rounds=args.rounds,
        request_length=args.request_length, sub_question_length=args.sub_question_length,
        output_length=args.output_length, shared_prefix=args.shared_prefix,
        max_parallel=args.max_parallel, request_rate=args.request_rate,
        distribution=args.distribution, round_barrier=args.round_barrier,
        queue_policy=args.ready_queue, seed=args.seed, vocab=args.vocab, timeout_s=args.timeout)


@contextmanager
def progress_bars(labels: list[str], total: int) -> Iterator[dict[str, Any]]:
    """A rich progress bar per row on stderr; yields each row's callback."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as prog:
        tasks = {lb: prog.add_task(lb, total=total) for lb in labels}
        yield {lb: (lambda done, _t, task=task: prog.update(task, completed=done))
               for lb, task in tasks.items()}


def drive(rows: dict[str, tuple[str, dict[str, str]]], cfg: MultiturnConfig,
          args: argparse.Namespace) -> dict[str, list[RequestRecord]]:
    """Run the workload on every row (label -> (url, headers)), interleaved round by round."""
    eps = {}
    for label, (url, headers) in rows.items():
        hdrs = dict(headers)
        if args.api_key and "Authorization" not in hdrs:
            hdrs["Authorization"] = f"Bearer {args.api_key}"
        eps[label] = Endpoint(url, args.model, hdrs)
    with progress_bars(list(rows), cfg.clients * cfg.rounds) as bars:
        return run_interleaved(cfg, eps, bars)


def emit(args: argparse.Namespace, rows: dict[str, list[RequestRecord]], meta: dict[str, Any],
         predicted: dict[str, dict[int, float]] | None = None) -> None:
    print(report.tables(rows), flush=True)
    paths = report.emit(rows, args.out, meta, predicted, plots=not args.no_plots)
    print("wrote " + ", ".join(str(p) for p in paths))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.combine:
        print(report.combined(report.load_runs(args.combine), args.baseline))
        return 0
    cfg = config(args)
    meta: dict[str, Any] = {"config": asdict(cfg), "argv": sys.argv if argv is None else argv}
    if args.url:
        labels = args.label + [f"row{i}" for i in range(len(args.label), len(args.url))]
        t0 = time.monotonic()
        rows = drive({lb: (url, {}) for lb, url in zip(labels, args.url)}, cfg, args)
        emit(args, rows, {**meta, "machine": report.host_load(), "wall_s": time.monotonic() - t0})
        return 0
    # the live rows start real engines (the repo's test kit): found from any working directory
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.support.multiturn_stack import live

    return live(args, cfg, meta, lambda rows, c: drive(rows, c, args),
                lambda rows, m, pred: emit(args, rows, m, pred))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
