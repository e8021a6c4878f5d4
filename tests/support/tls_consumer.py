"""A real TLS consumer on loopback, for the https path of the dispatcher's HTTP client.

Blocking sockets in threads, not asyncio: the standard library's blocking handshake sends
the TLS alerts a real server sends (protocol version, certificate required), which an
asyncio server may not flush before it closes. ``mode`` says how it behaves:

- ``ok``: answers every request 200 on keep-alive connections;
- ``close``: closes (with close_notify) after each response;
- ``ragged``: ends the TCP connection after each response, without close_notify;
- ``hang``: accepts TCP and never answers the ClientHello;
- ``reset``: reads the ClientHello and closes without an alert;
- ``tls10``: speaks TLS 1.0 and 1.1 only;
- ``mtls``: requires a client certificate signed by ``client_ca``.

``ok`` with a ``client_ca`` asks for a client certificate without requiring one. It records
the connections it accepted, the SNI name of each handshake (None: no SNI) and every request
(its head's fields, its body, the connection it came on and the client certificate
presented on that connection: its SHA-256 fingerprint, None for none).
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import ssl
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import trustme


def ca_file(ca: trustme.CA, folder: Path) -> Path:
    """The CA's certificate as a PEM file in ``folder``: what SSL_CERT_FILE names."""
    path = folder / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


@dataclass
class TlsRequest:
    target: str
    headers: dict[str, str]
    body: bytes
    connection: int = 0  # the order in which its connection was accepted, from 1
    peer: str | None = None  # the client certificate's SHA-256 (hex); None: none presented


@dataclass
class TlsConsumer:
    cert: trustme.LeafCert
    mode: str = "ok"
    host: str = "127.0.0.1"
    client_ca: trustme.CA | None = None
    accepted: int = 0
    sni: list[str | None] = field(default_factory=list)
    requests: list[TlsRequest] = field(default_factory=list)
    handshake_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.cert.configure_cert(ctx)
        if self.mode == "tls10":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                ctx.minimum_version = ssl.TLSVersion.TLSv1
                ctx.maximum_version = ssl.TLSVersion.TLSv1_1
            ctx.set_ciphers("ALL:@SECLEVEL=0")
        if self.mode == "mtls":
            assert self.client_ca is not None
            ctx.verify_mode = ssl.CERT_REQUIRED
            self.client_ca.configure_trust(ctx)
        elif self.client_ca is not None:
            ctx.verify_mode = ssl.CERT_OPTIONAL
            self.client_ca.configure_trust(ctx)

        def on_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
            with self._lock:
                self.sni.append(name)

        ctx.sni_callback = on_sni
        self._ctx = ctx
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((self.host, 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]

    def url(self, name: str | None = None, path: str = "/hook") -> str:
        host = name or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"https://{host}:{self.port}{path}"

    def start(self) -> TlsConsumer:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> TlsConsumer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                number = self.accepted
                self._socks.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn, number), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, raw: socket.socket, number: int = 0) -> None:
        try:
            raw.settimeout(30)
        except OSError:  # stopped before this thread ran: the socket is closed already
            return
        if self.mode in ("hang", "reset"):
            with raw:
                if self.mode == "hang":
                    self._stop.wait(30)
                else:
                    raw.recv(4096)  # the ClientHello, then gone without an alert
            return
        # The handshake by hand: wrap_socket would close the socket when it fails.
        try:
            conn = self._ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except OSError:  # closed by stop meanwhile
            return
        with self._lock:
            self._socks.append(conn)
        with conn:
            try:
                conn.do_handshake()
            except (ssl.SSLError, OSError) as exc:
                with self._lock:
                    self.handshake_errors.append(type(exc).__name__)
                # The alert is sent; closing with the client's request unread would reset
                # the connection before the client reads it: end the writing side, drain.
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(65536):
                        pass
                return
            self._answer(conn, number)

    def _answer(self, conn: ssl.SSLSocket, number: int = 0) -> None:
        presented = conn.getpeercert(binary_form=True)
        peer = None if presented is None else hashlib.sha256(presented).hexdigest()
        reader = conn.makefile("rb")
        while not self._stop.is_set():
            try:
                line = reader.readline(65536)
                if not line:
                    return
                target = line.split(b" ")[1].decode()
                headers: dict[str, str] = {}
                while True:
                    line = reader.readline(65536)
                    if line in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = reader.read(int(headers.get("content-length", "0")))
            except (OSError, ValueError, IndexError):
                return
            with self._lock:
                self.requests.append(TlsRequest(target, headers, body, number, peer))
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            except OSError:
                return
            if self.mode == "close":
                with contextlib.suppress(OSError):
                    conn.unwrap().close()  # close_notify, then the TCP close
                return
            if self.mode == "ragged":
                conn.close()  # no close_notify (no unwrap): the TCP connection just ends
                return
