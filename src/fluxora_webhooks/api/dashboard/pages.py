"""The dashboard's routes: sign-in and sign-out, the overview, and the endpoint and
delivery pages (:mod:`.endpoint_pages`, :mod:`.delivery_pages`)."""

from __future__ import annotations

import hmac
import secrets
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from ... import tokens
from ...settings import parse_duration_ms
from ..deps import api_state
from ..routes.stats import read_stats
from . import delivery_pages, endpoint_pages
from .charts import overview_charts
from .render import (
    HERE,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    Forbidden,
    SignInRequired,
    Viewer,
    error_page,
    posted,
    render,
    set_cookie,
    viewer,
)

WINDOWS = ("15m", "1h", "6h", "24h", "7d")
# What a screen reader says for each window (the links show the short form).
WINDOW_NAMES = {
    "15m": "15 minutes",
    "1h": "1 hour",
    "6h": "6 hours",
    "24h": "24 hours",
    "7d": "7 days",
}
LOGIN_TTL_S = 600


def install(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.add_api_route("/login", login_form, methods=["GET"], include_in_schema=False)
    app.add_api_route("/login", sign_in, methods=["POST"], include_in_schema=False)
    app.add_api_route("/logout", sign_out, methods=["POST"], include_in_schema=False)
    app.add_api_route("/", overview, methods=["GET"], include_in_schema=False)
    app.include_router(endpoint_pages.router)
    app.include_router(delivery_pages.router)

    @app.exception_handler(SignInRequired)
    async def _sign_in(request: Request, exc: SignInRequired) -> Response:
        return RedirectResponse("/login", status_code=303)

    @app.exception_handler(Forbidden)
    async def _forbidden(request: Request, exc: Forbidden) -> Response:
        return error_page(request, 403, exc.message)


async def login_form(request: Request, failed: bool = False) -> HTMLResponse:
    nonce = secrets.token_urlsafe(24)
    response = render(
        request,
        "login.html",
        None,
        status=401 if failed else 200,
        nonce=nonce,
        failed=failed,
    )
    set_cookie(request, response, LOGIN_COOKIE, nonce, LOGIN_TTL_S)
    return response


async def sign_in(request: Request) -> Response:
    form = await request.form()
    token = str(form.get("token", "")).strip()
    nonce = str(form.get("nonce", ""))
    expected = request.cookies.get(LOGIN_COOKIE, "")
    if not expected or not hmac.compare_digest(nonce.encode(), expected.encode()):
        return await login_form(request, failed=True)
    async with api_state(request).connection() as conn:
        principal = await tokens.authenticate(conn, token)
        if principal is None:
            return await login_form(request, failed=True)
        session_id, _ = await tokens.open_session(conn, principal)
    response = RedirectResponse("/", status_code=303)
    set_cookie(request, response, SESSION_COOKIE, session_id, tokens.SESSION_TTL_S)
    response.delete_cookie(LOGIN_COOKIE, path="/")
    return response


async def sign_out(request: Request) -> Response:
    await posted(request, write=False)
    async with api_state(request).connection() as conn:
        await tokens.close_session(conn, request.cookies.get(SESSION_COOKIE, ""))
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


async def overview(
    request: Request, who: Annotated[Viewer, Depends(viewer)], window: str = "1h"
) -> HTMLResponse:
    if window not in WINDOWS:
        window = "1h"
    state = api_state(request)
    async with state.connection() as conn:
        found = await read_stats(
            state,
            conn,
            who.tenant,
            parse_duration_ms(window, "window"),
            with_series=True,
            detail=who.tenant is None,
        )
    return render(
        request,
        "overview.html",
        who,
        stats=found,
        charts=overview_charts(found["series"] or []),
        window=window,
        windows=WINDOWS,
        window_names=WINDOW_NAMES,
    )
