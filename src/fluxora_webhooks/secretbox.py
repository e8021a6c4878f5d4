"""Endpoint signing secrets at rest: sealed with ``WEBHOOK_ENCRYPTION_KEY``.

With a key configured, every secret the project writes to ``webhook_endpoints`` (``secret``,
and through a rotation ``secret_previous``) is stored as ``fxenc:v1:<key id>:<base64>``: the
base64 (url-safe, unpadded) of a 12-byte nonce and the AES-256-GCM ciphertext with its tag,
authenticated with the endpoint's id (a rotation's ``SET secret_previous = secret`` moves a
sealed value between columns, so it is bound to the endpoint, not to the column). So is an
endpoint's client certificate's private key, and the value of each of its custom headers
that carries a credential (``endpoints.seal_headers``). The key id
is a short hash of the key, so a reader picks the key that opens it: the current key, or
``WEBHOOK_ENCRYPTION_KEY_PREVIOUS`` during a key rotation (which opens, never seals).

Any other stored value is a plain secret, read as it is: rows written before the key was
set, or by a plain SQL insert, keep working beside sealed ones. ``fluxora-webhooks secrets
encrypt`` seals them (and re-seals the previous key's), ``secrets decrypt`` opens them all.

The ``cryptography`` package is imported only when a secret is sealed or opened: a producer
that only enqueues never loads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import logs
from .errors import ConfigError

KEY_VARIABLE = "WEBHOOK_ENCRYPTION_KEY"
PREVIOUS_KEY_VARIABLE = "WEBHOOK_ENCRYPTION_KEY_PREVIOUS"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
PREFIX = "fxenc:"
_VERSION = "v1"
# The key id: the first 8 hex digits of a hash of the key (it says which key, and nothing
# of the key itself).
_KEY_ID_LABEL = b"fluxora-webhooks encryption key id\x00"
_SEALED = re.compile(r"fxenc:v1:([0-9a-f]{8}):([A-Za-z0-9_-]+)", re.ASCII)
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]+={0,2}", re.ASCII)
_MAKE_ONE = "make one with `fluxora-webhooks secrets new-key`"

log = logging.getLogger(__name__)


class SecretLocked(ValueError):
    """A sealed secret that no configured key opens: sealed with another key (``key_id``),
    or altered. The endpoint is not sent to until a key that opens it is configured;
    the message names the key id, never the secret."""

    def __init__(self, endpoint_id: str, key_id: str, why: str) -> None:
        self.endpoint_id = endpoint_id
        self.key_id = key_id
        super().__init__(why)


@dataclass(frozen=True)
class Key:
    id: str
    material: bytes = field(repr=False)


def key_id(material: bytes) -> str:
    return hashlib.sha256(_KEY_ID_LABEL + material).hexdigest()[:8]


def new_key() -> str:
    """A new ``WEBHOOK_ENCRYPTION_KEY``: 32 random bytes, base64 (url-safe)."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


def parse_key(raw: str, variable: str) -> Key:
    """A key as the variable holds it: 32 bytes, base64 (standard or url-safe, padded or
    not). Anything else is a :class:`ConfigError` naming ``variable``, never the value."""
    text = raw.strip()
    if not text:
        raise ConfigError(variable, f"is set but empty (unset it, or {_MAKE_ONE})")
    mixed = ("-" in text or "_" in text) and ("+" in text or "/" in text)
    if mixed or not _BASE64.fullmatch(text):
        raise ConfigError(variable, f"is not base64 (32 random bytes, base64-encoded: {_MAKE_ONE})")
    body = text.rstrip("=").replace("-", "+").replace("_", "/")
    try:
        material = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(
            variable, f"is not base64 (32 random bytes, base64-encoded: {_MAKE_ONE})"
        ) from None
    if len(material) != KEY_BYTES:
        raise ConfigError(
            variable,
            f"decodes to {len(material)} bytes; it must be {KEY_BYTES} random bytes,"
            f" base64-encoded ({_MAKE_ONE})",
        )
    if len(set(material)) == 1:
        raise ConfigError(variable, f"is not a random key (one byte repeated): {_MAKE_ONE}")
    return Key(key_id(material), material)


@dataclass(frozen=True)
class Keyring:
    """The keys of this process: ``current`` seals (None: secrets are written in plain
    text), ``current`` and ``previous`` open."""

    current: Key | None = None
    previous: Key | None = None
    # The variables' texts, for the log scrubber.
    texts: tuple[str, ...] = field(default=(), repr=False)

    @property
    def configured(self) -> bool:
        return self.current is not None or self.previous is not None

    def _opening(self, wanted: str) -> list[Key]:
        return [k for k in (self.current, self.previous) if k is not None and k.id == wanted]

    def seal(self, secret: str, endpoint_id: str, *, replacing: str | None = None) -> str:
        """``secret`` as stored: sealed with the current key, or as it is without one.
        ``replacing``: the value stored before (a rotation's). A sealed one replaced by a
        process that has no key at all (a process of the fleet the key was not given to)
        is said: the endpoint's new secret is stored in plain text."""
        if self.current is None:
            if replacing is not None and is_sealed(replacing) and not self.configured:
                log.warning(
                    "endpoint %s: its secret was stored encrypted, but %s is not set here:"
                    " its new secret is stored in plain text (set the key on this process,"
                    " then run `fluxora-webhooks secrets encrypt`)",
                    endpoint_id,
                    KEY_VARIABLE,
                )
            return secret
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = os.urandom(NONCE_BYTES)
        sealed = AESGCM(self.current.material).encrypt(
            nonce, secret.encode("utf-8"), endpoint_id.encode("utf-8")
        )
        body = base64.urlsafe_b64encode(nonce + sealed).decode().rstrip("=")
        return f"{PREFIX}{_VERSION}:{self.current.id}:{body}"

    def open(self, stored: str, endpoint_id: str, what: str = "its secret") -> str:
        """The plain secret of a stored value (a plain one as it is). A sealed one no
        configured key opens raises :class:`SecretLocked`, whose message says ``what`` the
        value is (``its client certificate's private key``, ``the value of its header X``)."""
        if not is_sealed(stored):
            return stored
        found = _SEALED.fullmatch(stored)
        if found is None:
            raise SecretLocked(
                endpoint_id, "unknown", f"{what} is an encrypted value this version cannot read"
            )
        wanted, body = found.groups()
        keys = self._opening(wanted)
        if not keys:
            raise SecretLocked(
                endpoint_id,
                wanted,
                f"{what} is encrypted with key {wanted}, which is neither {KEY_VARIABLE}"
                f" nor {PREVIOUS_KEY_VARIABLE} here",
            )
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            data = b""
        if len(data) >= NONCE_BYTES + TAG_BYTES:
            for key in keys:
                try:
                    plain = AESGCM(key.material).decrypt(
                        data[:NONCE_BYTES], data[NONCE_BYTES:], endpoint_id.encode("utf-8")
                    )
                except InvalidTag:
                    continue
                return plain.decode("utf-8", "surrogateescape")
        raise SecretLocked(
            endpoint_id,
            wanted,
            f"{what}, encrypted with key {wanted}, does not open with that key (altered,"
            " or copied from another endpoint)",
        )

    def sealed_with_current(self, stored: str) -> bool:
        found = _SEALED.fullmatch(stored)
        return found is not None and self.current is not None and found.group(1) == self.current.id


NO_KEYS = Keyring()


def is_sealed(stored: str) -> bool:
    return stored.startswith(PREFIX)


def sealed_length(stored: str) -> int | None:
    """How many bytes the plain value of a sealed one has, read from its length alone (no
    key needed); None: not a sealed value this version reads."""
    found = _SEALED.fullmatch(stored)
    if found is None:
        return None
    body = found.group(2)
    try:
        data = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        return None
    size = len(data) - NONCE_BYTES - TAG_BYTES
    return size if size >= 0 else None


def sealed_key_id(stored: str) -> str | None:
    """The key id a stored value names (None: a plain secret)."""
    found = _SEALED.fullmatch(stored)
    return found.group(1) if found else ("unknown" if is_sealed(stored) else None)


def keyring_from_env(env: Mapping[str, str]) -> Keyring:
    """The keys ``env`` configures (its ``_FILE`` variables already read, as
    ``settings.with_secret_files`` does). A bad value is a :class:`ConfigError` naming the
    variable; the previous key alone opens old values while new ones are written plain.
    The keys' texts are registered with the log scrubber here, so that every process that
    reads them (``run``, its supervisor, ``api``, the commands) never writes them."""
    current_raw = env.get(KEY_VARIABLE)
    previous_raw = env.get(PREVIOUS_KEY_VARIABLE)
    texts = tuple(t.strip() for t in (current_raw, previous_raw) if t is not None)
    # As given, and without its padding (a key is taken padded or not, so either form
    # may be the one something writes). Before parsing: a refused value is masked too.
    logs.add_sensitive(*texts, *(t.rstrip("=") for t in texts))
    current = None if current_raw is None else parse_key(current_raw, KEY_VARIABLE)
    previous = None if previous_raw is None else parse_key(previous_raw, PREVIOUS_KEY_VARIABLE)
    if current is not None and previous is not None and current.id == previous.id:
        if not hmac.compare_digest(current.material, previous.material):
            # Two keys, one id (a 1 in 2**32 chance): a value would name both, and
            # `secrets encrypt` would take the previous key's values for the current's.
            raise ConfigError(
                KEY_VARIABLE,
                f"has the same key id ({current.id}) as {PREVIOUS_KEY_VARIABLE} but is another"
                " key: make another one with `fluxora-webhooks secrets new-key`",
            )
        previous = None  # the same key twice: nothing to fall back on
    return Keyring(current, previous, texts)
