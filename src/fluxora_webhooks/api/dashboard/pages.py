"""The dashboard's routes: sign-in and sign-out, the overview, and the endpoint and
delivery pages (:mod:`.endpoint_pages`, :mod:`.delivery_pages`)."""

from __future__ import annotations

import hmac
import time
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from ... import tokens
from ...settings import parse_duration_ms
from ..deps import api_state
from ..routes.stats import read_stats
from . import delivery_pages, endpoint_forms, endpoint_pages, signin
from .charts import overview_charts
from .render import (
    HERE,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    Forbidden,
    SignInRequired,
    Viewer,
    back_to,
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
# The session cookie outlives its session by this much: a page asked for with a session
# that has ended (expired, its token revoked) says so and leads back after the sign-in,
# rather than a cookie gone with the session leaving a bare sign-in form. The cookie holds
# only the session's random id, worth nothing once the session has ended.
ENDED_SESSION_NOTICE_S = 7 * 86_400


def install(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.add_api_route("/login", login_form, methods=["GET"], include_in_schema=False)
    app.add_api_route("/login", sign_in, methods=["POST"], include_in_schema=False)
    app.add_api_route("/logout", sign_out, methods=["POST"], include_in_schema=False)
    app.add_api_route("/", overview, methods=["GET"], include_in_schema=False)
    # First: its /endpoints/new is not an endpoint's id.
    app.include_router(endpoint_forms.router)
    app.include_router(endpoint_pages.router)
    app.include_router(delivery_pages.router)

    @app.exception_handler(SignInRequired)
    async def _sign_in(request: Request, exc: SignInRequired) -> Response:
        return RedirectResponse(exc.login_url(), status_code=303)

    @app.exception_handler(Forbidden)
    async def _forbidden(request: Request, exc: Forbidden) -> Response:
        return error_page(request, 403, exc.message)


def _after_sign_in(target: str) -> str:
    """Where a sign-in leads: ``next`` when it is a page of this site (checked again: the
    form's field can be anything), else the overview."""
    page = back_to(target, "/")
    return "/" if page.split("?")[0] in ("/login", "/logout") else page


async def login_form(
    request: Request,
    expired: str = "",
    next_page: Annotated[str, Query(alias="next")] = "",
) -> HTMLResponse:
    """``expired=1``: a page was asked for with a session that has ended; ``next``: that
    page, gone to after the sign-in."""
    return await _login_page(request, ended=expired == "1", next_page=next_page)


async def _login_page(
    request: Request,
    *,
    failed: bool = False,
    refused: bool = False,
    ended: bool = False,
    next_page: str = "",
) -> HTMLResponse:
    """The form, with a new value issued by the server (:mod:`.signin`). ``failed``: the
    token was wrong (401); ``refused``: the post was not one of this dashboard's forms, or
    its value was not issued here, has expired or was used (403)."""
    nonce = signin.make_value(await signin.login_key(request), int(time.time()))
    after = _after_sign_in(next_page)
    shown = failed or refused
    response = render(
        request,
        "login.html",
        None,
        status=403 if refused else 401 if failed else 200,
        nonce=nonce,
        failed=failed,
        refused=refused,
        ended=ended and not shown,
        result="Session ended" if ended and not shown else None,
        next_page=after if after != "/" else "",
    )
    set_cookie(request, response, LOGIN_COOKIE, nonce, signin.VALUE_TTL_S)
    return response


async def sign_in(request: Request) -> Response:
    form = await request.form()
    token = str(form.get("token", "")).strip()
    nonce = str(form.get("nonce", ""))
    next_page = str(form.get("next", ""))
    if signin.cross_site(request):
        return await _login_page(request, refused=True, next_page=next_page)
    # The form's value: the one its page set in the cookie, issued by this dashboard (its
    # MAC), not expired, and (below, once the token is right) not used before.
    expected = request.cookies.get(LOGIN_COOKIE, "")
    issued = signin.value_issued_at(await signin.login_key(request), nonce)
    if (
        not expected
        or not hmac.compare_digest(nonce.encode(), expected.encode())
        or issued is None
        or not signin.valid_now(issued, time.time())
    ):
        return await _login_page(request, refused=True, next_page=next_page)
    state = api_state(request)
    used = False
    async with state.connection() as conn:
        principal = await tokens.authenticate(conn, token)
        if principal is not None:
            used = not await signin.use_value(conn, nonce, issued)
            if not used:
                session_id, _ = await tokens.open_session(conn, principal)
    if used:
        return await _login_page(request, refused=True, next_page=next_page)
    if principal is None:
        # A wrong token waits its turn, as the API's 401s do (deps.FAILED_AUTH_PER_S).
        await state.failures.wait()
        return await _login_page(request, failed=True, next_page=next_page)
    response = RedirectResponse(_after_sign_in(next_page), status_code=303)
    cookie_s = tokens.SESSION_TTL_S + ENDED_SESSION_NOTICE_S
    set_cookie(request, response, SESSION_COOKIE, session_id, cookie_s)
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
    window_ms = parse_duration_ms(window, "window")
    async with state.connection() as conn:
        found = await read_stats(
            state,
            conn,
            who.tenant,
            window_ms,
            with_series=True,
            detail=who.tenant is None,
        )
    return render(
        request,
        "overview.html",
        who,
        stats=found,
        charts=overview_charts(found["series"] or [], window_ms, WINDOW_NAMES[window]),
        window=window,
        windows=WINDOWS,
        window_names=WINDOW_NAMES,
    )
