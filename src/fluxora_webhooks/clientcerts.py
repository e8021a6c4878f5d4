"""Endpoints' own TLS client certificates: checked as they are set, described as the CLI,
the API and the dashboard show them, and loaded into the ``ssl.SSLContext`` a dispatcher
presents to that endpoint's consumer.

A certificate is stored as given (its PEM chain: the certificate first, then any
intermediates); its private key is a secret, stored as an endpoint's signing secret is
(sealed with ``WEBHOOK_ENCRYPTION_KEY`` when one is set, see :mod:`secretbox`), and never
shown, logged or returned. What is shown is the certificate's subject, issuer, SHA-256
fingerprint and expiry (:class:`Described`).

The ``cryptography`` package is imported only when a certificate is checked, described or
loaded: a producer that only enqueues never loads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import ssl
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from .errors import ConfigError

# Far more than a chain of a few certificates and a key take (a 4096-bit RSA key is about
# 3.3 KB of PEM); an upload larger than this is no certificate of ours.
MAX_CHAIN_BYTES = 64 * 1024
MAX_KEY_BYTES = 16 * 1024
# The certificate and its intermediates: sent in every handshake.
MAX_CHAIN_CERTIFICATES = 10
# The key sizes and curves TLS signs with. Checking an RSA key costs time growing with its
# size to the fourth (about 0.3 s at 4096 bits, 35 s at 16384): a larger one is refused
# before it is checked.
RSA_BITS = (2048, 4096)
EC_CURVES = ("secp256r1", "secp384r1", "secp521r1")
# What no PEM file holds, and PostgreSQL's text or UTF-8 cannot: a NUL, another control
# character (tabs and line ends aside), a lone surrogate.
_NOT_PEM_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
_PEM_BLOCK = re.compile(
    r"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.DOTALL | re.ASCII
)


class CertificateUnusable(ValueError):
    """A stored certificate and key that cannot be loaded (a row written past the checks of
    the CLI and the API): the reason, never the key."""


@dataclass(frozen=True)
class Described:
    """What is shown of an endpoint's client certificate (its leaf)."""

    subject: str
    issuer: str
    not_after: datetime
    fingerprint_sha256: str  # hex, lowercase, no separators
    # Its start of validity: one given before it (a renewal set ahead of time) is taken,
    # and said to be not valid yet until then.
    not_before: datetime | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "issuer": self.issuer,
            "not_before": None if self.not_before is None else self.not_before.isoformat(),
            "not_after": self.not_after.isoformat(),
            "fingerprint_sha256": self.fingerprint_sha256,
        }


@dataclass(frozen=True)
class ClientTls:
    """A client certificate loaded for sending: ``fingerprint`` (the SHA-256 of the chain's
    certificates, in order: of the certificate alone when it comes without intermediates)
    names it, and the connections made with it (the dispatcher keeps them apart from any
    other certificate's); ``context`` verifies consumers as the deployment's context does
    and presents it."""

    fingerprint: str
    context: ssl.SSLContext = field(repr=False, compare=False)
    # The certificate's validity: a consumer that checks it refuses it outside, and an
    # attempt that fails then says so (dispatcher._attempt).
    not_after: datetime | None = field(default=None, compare=False)
    not_before: datetime | None = field(default=None, compare=False)


EXPIRED = "expired"
NOT_YET_VALID = "not yet valid"
VALID = "valid"


def validity(
    not_before: datetime | None, not_after: datetime | None, now: datetime | None = None
) -> str:
    """Whether a certificate with these dates is EXPIRED, NOT_YET_VALID or VALID at ``now``
    (a consumer that checks it refuses it outside them)."""
    now = now or datetime.now(UTC)
    if not_after is not None and not_after <= now:
        return EXPIRED
    if not_before is not None and not_before > now:
        return NOT_YET_VALID
    return VALID


def split_pem(text: str) -> tuple[str, str | None]:
    """A PEM file's certificates and its private key, apart (None: no key in it), as one
    file holding both is read for ``WEBHOOK_TLS_CLIENT_CERT``."""
    certs: list[str] = []
    keys: list[str] = []
    for block in _PEM_BLOCK.finditer(text):
        (keys if "PRIVATE KEY" in block.group(1) else certs).append(block.group(0))
    if not keys:
        return text, None
    return "".join(c if c.endswith("\n") else c + "\n" for c in certs), "".join(keys)


def _certificates(chain: str, name: str) -> list[Any]:
    from cryptography import x509

    if not isinstance(chain, str) or not chain.strip():
        raise ConfigError(name, "is empty: give the PEM certificate (-----BEGIN CERTIFICATE-----)")
    _check_text(chain, name, MAX_CHAIN_BYTES)
    if "PRIVATE KEY-----" in chain:
        raise ConfigError(name, "holds a private key: give the key on its own")
    try:
        certs = x509.load_pem_x509_certificates(chain.encode())
    except ValueError:
        raise ConfigError(
            name, "is not a PEM certificate chain (-----BEGIN CERTIFICATE----- ...)"
        ) from None
    return certs


def _check_text(text: str, name: str, limit: int) -> None:
    """``text`` holds nothing PEM text cannot (a NUL, a control character, a lone
    surrogate) and is no larger than ``limit`` bytes: said naming ``name``, never quoting
    the text."""
    if len(text) > limit:  # before it is searched
        raise ConfigError(name, f"is larger than {limit // 1024} KiB")
    if _NOT_PEM_TEXT.search(text):
        raise ConfigError(
            name, "holds what PEM text cannot (a NUL, a control character, a lone surrogate)"
        )
    if len(text.encode()) > limit:
        raise ConfigError(name, f"is larger than {limit // 1024} KiB")


def _key_kind(public: Any) -> str | None:
    """What is wrong with the key of a client certificate (\"a 16384-bit RSA key: ...\";
    None: a key TLS clients sign with)."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

    if isinstance(public, rsa.RSAPublicKey):
        low, high = RSA_BITS
        if not low <= public.key_size <= high:
            return f"a {public.key_size}-bit RSA key: give one of {low} to {high} bits"
        return None
    if isinstance(public, ec.EllipticCurvePublicKey):
        if public.curve.name not in EC_CURVES:
            return (
                f"an EC key on {public.curve.name}, which TLS does not sign with: give one"
                " on P-256, P-384 or P-521"
            )
        return None
    if isinstance(public, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return None
    return (
        f"a key of a kind TLS client certificates cannot use ({type(public).__name__}):"
        " give an RSA, EC (P-256, P-384, P-521) or Ed25519 key"
    )


def _client_auth_problem(cert: Any) -> str | None:
    """Why consumers refuse ``cert`` as a client's (None: its usages allow it)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        pass
    else:
        if (
            ExtendedKeyUsageOID.CLIENT_AUTH not in usages
            and ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE not in usages
        ):
            return (
                "does not allow TLS client authentication (its extended key usage lacks"
                " clientAuth): give a client certificate"
            )
    try:
        key_usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return None
    if not key_usage.digital_signature:
        return (
            "does not allow signing (its key usage lacks digitalSignature), which TLS client"
            " authentication needs: give a client certificate"
        )
    return None


def _same_key(public: Any, cert: Any) -> bool:
    from cryptography.hazmat.primitives import serialization

    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return bool(public.public_bytes(der, spki) == cert.public_key().public_bytes(der, spki))


def _fingerprint(certs: list[Any]) -> str:
    from cryptography.hazmat.primitives import hashes, serialization

    if len(certs) == 1:
        return bytes(certs[0].fingerprint(hashes.SHA256())).hex()
    whole = hashlib.sha256()
    for cert in certs:
        whole.update(cert.public_bytes(serialization.Encoding.DER))
    return whole.hexdigest()


def _describe(cert: Any) -> Described:
    from cryptography.hazmat.primitives import hashes

    return Described(
        subject=cert.subject.rfc4514_string(),
        issuer=cert.issuer.rfc4514_string(),
        not_after=cert.not_valid_after_utc,
        fingerprint_sha256=bytes(cert.fingerprint(hashes.SHA256())).hex(),
        not_before=cert.not_valid_before_utc,
    )


def check(
    chain: str,
    key: str,
    *,
    chain_name: str = "certificate",
    key_name: str = "private_key",
    now: datetime | None = None,
) -> Described:
    """A certificate chain and its private key, both PEM, as an endpoint may take them: the
    chain parses, the key parses and is not encrypted (a dispatcher has no passphrase to
    give), the key is the certificate's (the chain's first), of a kind and size TLS clients
    sign with (checked before the key's costly check), the certificate's usages allow client
    authentication, and it has not expired. Anything else is a :class:`ConfigError` naming
    ``chain_name`` or ``key_name`` (never the key)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    certs = _certificates(chain, chain_name)
    if len(certs) > MAX_CHAIN_CERTIFICATES:
        raise ConfigError(
            chain_name,
            f"holds {len(certs)} certificates: give the certificate and its intermediates"
            f" ({MAX_CHAIN_CERTIFICATES} at most)",
        )
    leaf = certs[0]
    kind = _key_kind(leaf.public_key())
    if kind is not None:
        raise ConfigError(chain_name, f"holds {kind}")
    usage = _client_auth_problem(leaf)
    if usage is not None:
        raise ConfigError(chain_name, usage)
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(key_name, "is empty: give the certificate's PEM private key")
    _check_text(key, key_name, MAX_KEY_BYTES)
    if "ENCRYPTED" in key:
        raise ConfigError(key_name, _ENCRYPTED)
    try:
        # Read unchecked first: checking a key costs time growing with its size, and only
        # the certificate's (of a size taken above) is worth it.
        unchecked = serialization.load_pem_private_key(
            key.encode(), password=None, unsafe_skip_rsa_key_validation=True
        )
        if not _same_key(unchecked.public_key(), leaf):
            if any(_same_key(unchecked.public_key(), other) for other in certs[1:]):
                raise ConfigError(
                    chain_name,
                    "is in the wrong order: give the key's certificate first, then its"
                    " intermediates",
                )
            raise ConfigError(key_name, "is not the certificate's private key (they do not match)")
        serialization.load_pem_private_key(key.encode(), password=None)
    except TypeError:  # "password was not given but private key is encrypted"
        raise ConfigError(key_name, _ENCRYPTED) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(
            key_name, "is not a PEM private key (-----BEGIN PRIVATE KEY----- ...)"
        ) from None
    try:  # what OpenSSL itself takes (not every key type cryptography reads is one TLS uses)
        _load_into(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), chain, key)
    except CertificateUnusable:
        raise ConfigError(
            key_name, "is a key of a kind TLS client certificates cannot use"
        ) from None
    described = _describe(leaf)
    if validity(None, described.not_after, now) == EXPIRED:
        raise ConfigError(
            chain_name,
            f"expired on {described.not_after.isoformat()} ({described.subject}): give a"
            " current certificate",
        )
    return described


_ENCRYPTED = (
    "is encrypted: give it unencrypted (a dispatcher has no passphrase to give; it is stored"
    " encrypted with WEBHOOK_ENCRYPTION_KEY when that is set)"
)


@lru_cache(maxsize=512)
def describe(chain: str) -> Described | None:
    """What is shown of a stored chain (None: it cannot be read; a row written by SQL).
    Remembered for the lists that show the same endpoints page after page."""
    try:
        return _describe(_certificates(chain, "certificate")[0])
    except (ConfigError, ValueError):
        return None


def load(chain: str, key: str) -> ClientTls:
    """The context that presents ``chain`` with ``key`` (the system's trust store, as the
    deployment's context has; SSL_CERT_FILE and SSL_CERT_DIR apply). Loading the trust store
    takes tens of milliseconds: not on an event loop (the dispatcher loads in a thread).
    Raises :class:`CertificateUnusable` saying why."""
    try:
        certs = _certificates(chain, "certificate")
    except ConfigError as exc:
        raise CertificateUnusable(f"its client certificate {exc.problem}") from None

    context = ssl.create_default_context()
    _load_into(context, chain, key)
    return ClientTls(
        _fingerprint(certs), context, certs[0].not_valid_after_utc, certs[0].not_valid_before_utc
    )


def _load_into(context: ssl.SSLContext, chain: str, key: str) -> None:
    """``context.load_cert_chain`` of texts. The key reaches OpenSSL through a file only:
    one in a directory of this process's own (0700), removed as soon as it is read."""

    def encrypted() -> bytes:
        raise CertificateUnusable("its client certificate's private key is encrypted")

    with tempfile.TemporaryDirectory(prefix="fluxora-client-cert-") as folder:
        cert_path = os.path.join(folder, "cert.pem")
        key_path = os.path.join(folder, "key.pem")
        for path, text in ((cert_path, chain), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
        try:
            context.load_cert_chain(cert_path, key_path, password=encrypted)
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                why = "its client certificate's private key is not the certificate's"
            else:
                why = "its client certificate or its private key cannot be loaded"
            raise CertificateUnusable(why) from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(key_path)
