"""The master's ``/status`` (one JSON document) and ``/dashboard`` (a page that charts it).

``/status`` is what ``kvplane status`` and ``kvplane top`` read; ``?history=1`` adds the
master's ring of samples (``kvplane.store.master.status.History``), which the dashboard
charts. ``/dashboard`` is one self-contained HTML page: its script and style are package
data (``static/``), inlined when served, so the page needs no second request, no build step
and no CDN. Both need the service or admin token; a browser may pass it once as
``/dashboard?token=...`` (``kvplane.common.http_guard.QUERY_TOKEN_PATHS``): the page keeps it in
sessionStorage, drops it from the address bar, and sends it as ``Authorization: Bearer`` on
every poll of ``/status``. Binds nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse

from kvplane.common.auth import Principal

StatusFn = Callable[[bool, bool], dict[str, Any]]


@functools.cache
def page() -> str:
    """The dashboard page with its script and style inlined."""
    static = resources.files("kvplane.store.master") / "static"
    html = (static / "dashboard.html").read_text(encoding="utf-8")
    css = (static / "dashboard.css").read_text(encoding="utf-8")
    js = (static / "dashboard.js").read_text(encoding="utf-8")
    return html.replace("/*STYLE*/", css).replace("/*SCRIPT*/", js)


def install(app: FastAPI, status: StatusFn, infra: Callable[[Request], Principal]) -> None:
    """Add ``/status`` and ``/dashboard`` to the admin ``app``.

    Args:
        app: the master's admin app.
        status: ``(admin, with_history) -> document``.
        infra: the caller's principal, refusing tenant tokens (segments are infrastructure).
    """

    @app.get("/status")
    def get_status(request: Request, history: bool = Query(False, description="include samples")
                   ) -> dict[str, Any]:
        """Segments, objects, evictions, ops and rates in one document (see docs/deploy.md)."""
        return status(infra(request).admin, history)

    @app.get("/dashboard", response_class=HTMLResponse)
    def get_dashboard(request: Request) -> HTMLResponse:
        """The live dashboard (polls /status?history=1)."""
        infra(request)
        return HTMLResponse(page(), headers={"Cache-Control": "no-store",
                                             "Referrer-Policy": "no-referrer",
                                             "Content-Security-Policy": _CSP})


# the page loads nothing from anywhere: inline script and style, fetches to this origin only
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")
