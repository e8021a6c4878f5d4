"""A Django consumer that applies each webhook exactly once, with the inbox.

    export DATABASE_URL=postgresql://app@db/app WEBHOOK_SECRET=...   # the sender's secret
    python examples/consumer_django.py setup          # webhook_inbox and the example's table
    python examples/consumer_django.py runserver 127.0.0.1:8000 --noreload

Then point the dispatcher at it: ``WEBHOOK_URL=http://127.0.0.1:8000/webhooks``.

One file for brevity; in a project the view lives in ``views.py`` and the settings in
``settings.py``. What matters is the view: inside ``transaction.atomic()``, Django's
``connection.connection`` is the psycopg 3 connection that runs Django's transaction, so
``inbox.receive`` records the delivery id in the same transaction as the ORM's and the
cursor's writes. They commit together or not at all:

- a new event: applied, 200 ``processed``;
- a repeat (the sender retried after a lost answer): nothing applied, 200 ``duplicate``,
  so the sender stops;
- a bad signature: 401, nothing recorded;
- the handler fails (here: a debit larger than the balance breaks a CHECK constraint):
  the exception leaves the atomic block, Django rolls back the delivery id with the rest
  and answers 500, and the sender retries later.

Outside ``atomic()`` Django runs in autocommit mode, and ``receive`` refuses to work there
(``ValueError``): the id would commit on its own, apart from the writes it guards.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import django
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict

from fluxora_webhooks import inbox
from fluxora_webhooks.errors import VerificationError

BALANCES = """
CREATE TABLE IF NOT EXISTS example_balances (
    account text PRIMARY KEY,
    amount  bigint NOT NULL CHECK (amount >= 0)
)
"""


def database_settings(url: str) -> dict[str, Any]:
    """Django's DATABASES entry for a libpq URL (psycopg 3 is Django's PostgreSQL driver)."""
    info = conninfo_to_dict(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": info.get("dbname", ""),
        "USER": info.get("user", ""),
        "PASSWORD": info.get("password", ""),
        "HOST": info.get("host", ""),
        "PORT": info.get("port", ""),
    }


if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY=os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret"),
        ALLOWED_HOSTS=["127.0.0.1", "localhost"],
        ROOT_URLCONF=__name__,
        DATABASES={"default": database_settings(os.environ["DATABASE_URL"])},
        INSTALLED_APPS=[],
        MIDDLEWARE=[],
        USE_TZ=True,
        # A failed handler is a 500 for the sender and a traceback for you.
        LOGGING={
            "version": 1,
            "handlers": {"console": {"class": "logging.StreamHandler"}},
            "loggers": {"django.request": {"handlers": ["console"], "level": "ERROR"}},
        },
    )
    django.setup()

from django.db import connection, transaction  # noqa: E402  (needs the settings above)
from django.http import HttpRequest, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.csrf import csrf_exempt  # noqa: E402
from django.views.decorators.http import require_POST  # noqa: E402

SECRET = os.environ.get("WEBHOOK_SECRET", "")
PREVIOUS = os.environ.get("WEBHOOK_SECRET_PREVIOUS") or None


def apply(event: inbox.InboxEvent) -> None:
    """Your business logic: here, credit (or debit) an account. Any write made through
    Django (ORM or cursor) joins the transaction that recorded the delivery id."""
    account = str(event.payload["account"])
    amount = int(event.payload["amount"])
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE example_balances SET amount = amount + %s WHERE account = %s",
            [amount, account],
        )
        if cur.rowcount == 0:
            cur.execute(
                "INSERT INTO example_balances (account, amount) VALUES (%s, %s)",
                [account, amount],
            )


@csrf_exempt  # the signature is the authentication: there is no browser session here
@require_POST
def webhook(request: HttpRequest) -> JsonResponse:
    try:
        with transaction.atomic():
            event = inbox.receive(
                connection.connection,  # the psycopg connection of this transaction
                body=request.body,
                headers=request.headers,
                secret=SECRET,
                previous_secret=PREVIOUS,
                scheme="standard",  # the scheme that signs the delivery id too
            )
            if event is None:
                return JsonResponse({"status": "duplicate"})
            apply(event)  # raises: rolled back, Django answers 500, the sender retries
            # A database error apply caught (without a savepoint) would make the commit a
            # quiet rollback: raise instead (500), so that the sender retries.
            inbox.check_committable(connection.connection)
    except VerificationError as exc:
        if exc.reason in ("bad_payload", "bad_delivery_id"):  # signed, but unusable: 400
            return JsonResponse({"error": "bad_request", "reason": exc.reason}, status=400)
        return JsonResponse({"error": "verification_failed", "reason": exc.reason}, status=401)
    return JsonResponse({"status": "processed", "delivery_id": event.delivery_id})


urlpatterns = [path("webhooks", webhook)]


def setup() -> None:
    """The inbox table and the example's own table, in one transaction."""
    with transaction.atomic():
        created = inbox.install(connection.connection)
        with connection.cursor() as cur:
            cur.execute(BALANCES)
    print("created webhook_inbox" if created else "webhook_inbox is already installed")


if __name__ == "__main__":
    if sys.argv[1:] == ["setup"]:
        setup()
    else:
        if not SECRET:
            sys.exit("WEBHOOK_SECRET is required (the same secret as the dispatcher's)")
        from django.core.management import execute_from_command_line

        execute_from_command_line(sys.argv)
