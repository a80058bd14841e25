"""The web page at `/`: host and engines, models, live performance and a chat box, from static files
shipped in the package (plain ES modules, no framework, no build step) and the JSON of `/api/*`."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from gateway.web.live import LiveStats, Resident
from gateway.web.status import router as status_router

STATIC = Path(__file__).resolve().parent / "static"

# Only the page's own files and its own origin: no inline script, nothing from elsewhere.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

page = APIRouter(include_in_schema=False)


@page.get("/")
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=_PAGE_HEADERS)


def install(app: FastAPI, resident: Resident) -> None:
    """Mount the page, its files under /web/ and the /api routes; `resident` reads the engines' gauges."""
    app.state.live = LiveStats(app.state.metrics, resident)
    app.include_router(status_router)
    app.include_router(page)
    app.mount("/web", StaticFiles(directory=STATIC), name="web")
