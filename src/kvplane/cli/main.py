"""``kvplane`` entry point: builds the typer app from the subcommand modules and configures logging.

Each module in ``COMMAND_MODULES`` exposes ``register(app: typer.Typer) -> None``; ``main`` runs
the app through ``kvplane.cli.errors.run`` (one-line errors, exit codes 1 and 2, ``--debug``).
"""

from __future__ import annotations

import importlib
import sys

import typer
import typer.core

from kvplane.cli import errors
from kvplane.common import envs, log

COMMAND_MODULES = [
    "kvplane.cli.metadata",
    "kvplane.cli.store",
    "kvplane.cli.conductor",
    "kvplane.cli.simulate",
    "kvplane.cli.router",
    "kvplane.cli.pd_proxy",
    "kvplane.cli.serve",
    "kvplane.cli.bench",
    "kvplane.cli.p2p",
    "kvplane.cli.status",
    "kvplane.cli.tokens",
]

app = typer.Typer(
    name="kvplane",
    help=(
        "kvplane: the KVCache-centric data plane for LLM inference.\n\n"
        "Start with `kvplane serve` (a store master, the metadata server, the admin/metrics port "
        "and a 1 GiB DRAM segment, all on 127.0.0.1), then point clients at it. Every service binds "
        "127.0.0.1 unless --host says otherwise and "
        "requires a token (--token, KVPLANE_TOKEN, or the token file it generates and local clients read; "
        "--no-auth turns this off). Each command's --help explains it."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _flag_type(self: typer.core.TyperOption, ctx: typer.Context) -> str | None:
    """The type column of an option's help row: none for a flag (typer would print ``<bool>``
    for every on/off switch); size options name theirs (``SIZE``, ``lifecycle.size_option``)."""
    return None if self.is_flag else _OPTION_TYPE(self, ctx)


_OPTION_TYPE = typer.core.TyperOption.display_type_rich
setattr(typer.core.TyperOption, "display_type_rich", _flag_type)  # noqa: B010  # one help-format fix for every command; tests/integration/cli/test_cli_mistakes.py pins it


@app.callback()
def _root(
    log_level: str = typer.Option(None, help="Log level (default: KVPLANE_LOG_LEVEL or INFO)."),
    log_json: bool = typer.Option(None, "--log-json/--no-log-json",
                                  help="One JSON object per log line (default: KVPLANE_LOG_JSON)."),
    debug: bool = typer.Option(False, "--debug", help="On failure print the traceback, not just "
                               "the one-line error (also KVPLANE_DEBUG=1)."),
) -> None:
    errors.set_debug(debug)
    log.setup(log_level or envs.get("KVPLANE_LOG_LEVEL"),
              envs.get("KVPLANE_LOG_JSON") if log_json is None else log_json)


def build() -> typer.Typer:
    """Register every subcommand module on the app (idempotent)."""
    if not getattr(app, "_kvplane_built", False):
        for name in COMMAND_MODULES:
            importlib.import_module(name).register(app)
        app._kvplane_built = True  # type: ignore[attr-defined]  # a marker on typer's object
    return app


def main() -> None:
    """Console-script entry point: exit 0, 1 (runtime failure) or 2 (usage error), one line
    on stderr when it fails (cli/errors.py)."""
    sys.exit(errors.run(build()))


if __name__ == "__main__":
    main()
