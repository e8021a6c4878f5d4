"""Templates, the signed-in viewer, CSRF checks and the error page, shared by the pages.

Sign-in: the token is checked once and a session opened (:mod:`...tokens`): the browser
keeps only a random session id in an HttpOnly, SameSite=Strict cookie. Every form carries
the session's CSRF token, compared in constant time; the sign-in form itself carries a
one-time value issued by the server that is also in a cookie, and a sign-in from another
origin is refused (:mod:`.signin`: a login CSRF cannot sign a browser in).
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader
from markupsafe import Markup

from ... import tokens
from ..._version import __version__
from ...tokens import Principal
from ...urlpolicy import BIDI_CONTROLS
from ..deps import api_state
from ..ratelimit import proven

HERE = Path(__file__).resolve().parent
SESSION_COOKIE = "fx_session"
LOGIN_COOKIE = "fx_login"
# A form's one-time key (secrets.token_urlsafe(18)): the same form posted again (a reload
# of the page that shows a new secret, a second click) does its work once. Kept as an
# idempotency key of the tenant, "dashboard:" + what the form does + it, for as long as the
# API's keys.
FORM_KEY = re.compile(r"[A-Za-z0-9_-]{24}")


def new_form_key() -> str:
    return secrets.token_urlsafe(18)


class _AsTyped(str):
    """A form field's value: posted back as it is, so printed as it is (escaped for HTML
    all the same); its escape would be saved in its place, another URL."""


def _as_typed(value: Any) -> _AsTyped:
    return _AsTyped("" if value is None else value)


def _shown(value: Any) -> Any:
    """Every value a template prints: a bidirectional control in text (a payload, a
    response body, an error, a description stored before they were refused), which would
    reorder what follows it ('/gpj.exe' shown as '/exe.jpg'), is shown as its escape
    (``\\u202e``, which a JSON string reads as the same character), not obeyed.
    Markup built by the pages themselves, and a form field's value (``as_typed``), are
    left as they are."""
    if isinstance(value, str) and not isinstance(value, Markup | _AsTyped):
        return BIDI_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
    return value


# autoescape on for every template: stored text is always escaped, and no template marks
# stored data safe.
env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=True, finalize=_shown)


def _when(value: str | datetime | None) -> str:
    if value is None:
        return "-"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _past(value: str | datetime | None) -> bool:
    """Whether a time (with its offset, as the API gives them) has passed."""
    if value is None:
        return False
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment <= datetime.now(UTC)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


env.filters.update(when=_when, past=_past, ms=_ms, pct=_pct, pretty_json=_json, as_typed=_as_typed)
env.globals.update(version=__version__)


@dataclass(frozen=True)
class Viewer:
    """The signed-in token and its session's CSRF token."""

    principal: Principal
    csrf: str

    @property
    def tenant(self) -> str | None:
        return self.principal.tenant

    @property
    def can_write(self) -> bool:
        return not self.principal.read_only


class SignInRequired(Exception):
    """No valid session: a page answers with the sign-in form. ``ended``: the request
    carried a session that is no longer valid (expired, its token revoked): the form says
    so, and the sign-in leads back to ``page`` (a path of this site, or '')."""

    def __init__(self, ended: bool = False, page: str = "") -> None:
        super().__init__("sign in")
        self.ended = ended
        self.page = page

    def login_url(self) -> str:
        if not self.ended:
            return "/login"
        wanted = {"expired": "1", **({"next": self.page} if self.page else {})}
        return "/login?" + urlencode(wanted)


class Forbidden(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def render(
    request: Request, name: str, viewer: Viewer | None, status: int = 200, **context: Any
) -> HTMLResponse:
    """``flash``: an action's result, shown above the page (and, with ``result``, its
    short form, first in the title: a screen reader says it as the page loads)."""
    html = env.get_template(name).render(request_path=request.url.path, viewer=viewer, **context)
    return HTMLResponse(html, status_code=status)


# The short reason in an error page's title and heading.
REASONS = {
    400: "Bad request",
    403: "Not allowed",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Too large",
    415: "Unsupported media type",
    422: "Not valid",
    500: "Internal error",
    429: "Too many requests",
    503: "Unavailable",
}
# The pages a failed request can lead back to: a list, and one of its items.
_LISTS = {"endpoints": "the endpoints", "deliveries": "the deliveries", "events": "the deliveries"}
_ITEMS = {"endpoints": "endpoint", "deliveries": "delivery", "events": "event"}


def _way_back(request: Request, status: int) -> tuple[str, str] | None:
    """A link to the page the failed request was made from: the form's ``next`` when it
    had one, else the page of the item acted on (its list when that item is not found,
    or when the request was a page's own)."""
    came_from: str = getattr(request.state, "fluxora_form_page", "")
    parts = (came_from or request.url.path).split("?")[0].split("/")[1:]
    kind = parts[0] if parts else ""
    if kind not in _LISTS:
        return None
    item = parts[1] if len(parts) > 1 else ""
    if came_from:
        return came_from, f"Back to {_ITEMS[kind]} {item}" if item else f"Back to {_LISTS[kind]}"
    if item and len(parts) > 2 and status != 404:  # a form's action: its item's page
        return f"/{kind}/{quote(item, safe='')}", f"Back to {_ITEMS[kind]} {item}"
    return ("/deliveries" if kind == "events" else f"/{kind}"), f"Back to {_LISTS[kind]}"


def error_page(request: Request, status: int, message: str) -> Response:
    if status == 401:
        return RedirectResponse("/login", status_code=303)
    # The signed-in viewer (its session found before the error) keeps the navigation: an
    # unauthenticated request never got as far, and sees none.
    who: Viewer | None = getattr(request.state, "fluxora_viewer", None)
    return render(
        request,
        "error.html",
        who,
        status=status,
        status_code=status,
        reason=REASONS.get(status, "Error"),
        error=message,
        back=_way_back(request, status),
    )


async def viewer(request: Request) -> Viewer:
    """The page's viewer from the session cookie, or :class:`SignInRequired`."""
    session_id = request.cookies.get(SESSION_COOKIE, "")
    if not session_id:
        raise SignInRequired()
    async with api_state(request).connection() as conn:
        found = await tokens.find_session(conn, session_id)
    if found is None:
        raise SignInRequired(ended=True, page=came_from(request))
    who = Viewer(*found)
    request.state.fluxora_viewer = who  # for an error page of this request
    proven(request.scope, f"the dashboard session of token {who.principal.name!r}")
    return who


async def posted(request: Request, *, write: bool = True) -> tuple[Viewer, dict[str, str]]:
    """A form post's viewer and its fields, once its CSRF token matched (and, for a change,
    its token may write)."""
    who = await viewer(request)
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    request.state.fluxora_form_page = back_to(form.get("next", "").split("#")[0], "")
    if not hmac.compare_digest(form.get("csrf", "").encode(), who.csrf.encode()):
        raise Forbidden("the form has expired or did not come from this dashboard; reload it")
    if write:
        require_write(who)
    return who, form


def require_write(who: Viewer) -> None:
    """A page or form that changes something: :class:`Forbidden` for a read-only token."""
    if not who.can_write:
        raise Forbidden("this token is read-only")


# A page to go back to longer than this is not one the dashboard wrote.
MAX_BACK_TO = 2000


def back_to(target: str, fallback: str) -> str:
    """A redirect target from a form: a path on this site only (never //host or a URL,
    nor a control character or a space a browser would drop from it)."""
    if (
        target.startswith("/")
        and not target.startswith("//")
        and "\\" not in target
        and len(target) <= MAX_BACK_TO
        and target.isprintable()
        and " " not in target
    ):
        return target
    return fallback


def came_from(request: Request) -> str:
    """The page a request whose session ended was made from, to go back to once signed in
    again (a path of this site, or ''): a page's own path and query; for a form, the page
    it was posted from (its ``next`` field is not read before the session is: the
    Referer, when it is this site's, else the page of the item the form acts on)."""
    url = request.url
    if request.method in ("GET", "HEAD"):
        return back_to(url.path + (f"?{url.query}" if url.query else ""), "")
    referer = urlsplit(request.headers.get("referer", ""))
    if (referer.scheme, referer.netloc) == (url.scheme, url.netloc) and referer.path:
        return back_to(referer.path + (f"?{referer.query}" if referer.query else ""), "")
    parts = url.path.split("/")
    if parts[1:2] == ["logout"]:
        return ""
    # /endpoints/{id}/disable: the endpoint's page; a form's own page (/endpoints/new,
    # /endpoints/{id}/edit, /events/new?endpoint_id=...): that form again.
    if len(parts) > 3 and parts[3] != "edit":
        return back_to("/".join(parts[:3]), "")
    return back_to(url.path + (f"?{url.query}" if url.query else ""), "")


def secure(request: Request) -> bool:
    return request.url.scheme == "https"


def set_cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path="/",
        httponly=True,
        samesite="strict",
        secure=secure(request),
    )
