"""The shards' side of the job's keys: a ZAP handler that admits only them.

One handler per ZeroMQ context (pyzmq's ThreadAuthenticator, with PLAIN tokens compared
in constant time), shared by the serving sockets of that context, each under its own ZAP
domain: a CurveZMQ or PLAIN socket admits the keys or tokens of its ServerSecurity and
names the peer by its key (the ZAP User-Id), so that a shard can tell the chief apart. A
peer without the job's keys fails the handshake and gets nothing back.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import threading
import time
from typing import Any, Callable

from distbelief.runtime import errors
from distbelief.runtime.keys import ServerSecurity

log = logging.getLogger(__name__)

REFUSAL_LOG_SECONDS = 10.0  # at most one refusal line per domain this often (a peer may retry fast)
ZAP_RESTART_SECONDS = 2.0


class _Allowed:
    """ThreadAuthenticator credentials provider: ZAP domain -> admitted public keys."""

    def __init__(self) -> None:
        self.by_domain: dict[str, frozenset[bytes]] = {}
        self._refusals: dict[str, tuple[float, int]] = {}  # domain -> (last logged, since then)

    def callback(self, domain: str, key: bytes) -> bool:
        admitted = key in self.by_domain.get(domain, frozenset())
        if not admitted:
            self.log_refusal(domain, "unknown_client_key")
        return admitted

    def log_refusal(self, domain: str, reason: str) -> None:
        now = time.monotonic()
        last, count = self._refusals.get(domain, (float("-inf"), 0))
        if now - last >= REFUSAL_LOG_SECONDS:
            log.warning("event=peer_refused domain=%s reason=%s refused=%d", domain, reason, count + 1)
            self._refusals[domain] = (now, 0)
        else:
            self._refusals[domain] = (last, count + 1)


def _authenticator(context: Any, log: logging.Logger, allowed: _Allowed) -> Any:
    """pyzmq's ThreadAuthenticator, but with PLAIN tokens compared in constant time (its own
    check is `==`, whose time tells how much of a guess was right), and a start that waits
    out the ZAP endpoint of a handler just stopped in the context (libzmq frees it later)."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    class ConstantTimeAuthenticator(ThreadAuthenticator):
        def start(self) -> None:
            deadline = time.monotonic() + ZAP_RESTART_SECONDS
            while True:
                try:
                    return super().start()
                except zmq.ZMQError as exc:
                    super().stop()  # closes the socket the failed bind left open
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.01)

        def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
            expected = self.passwords.get(domain or "*", {}).get(username)
            allowed = expected is not None and hmac.compare_digest(password.encode(), expected.encode())
            return allowed, b"OK" if allowed else b"Invalid credentials"

    return ConstantTimeAuthenticator(context, log=log)


class _ContextAuth:
    def __init__(self, context: Any) -> None:
        self.allowed = _Allowed()
        zap_log = logging.getLogger(__name__ + ".zap")
        zap_log.setLevel(logging.INFO)  # never debug: pyzmq logs PLAIN passwords (our join tokens) there
        self.authenticator = _authenticator(context, zap_log, self.allowed)
        self.authenticator.start()
        self.users = 0


_auth_lock = threading.Lock()
_auth_by_context: dict[int, _ContextAuth] = {}


@dataclasses.dataclass
class Admission:
    """A shard's registration with its context's ZAP handler; close() when it stops serving."""

    context: Any
    domain: str
    closed: bool = False

    def close(self) -> None:
        with _auth_lock:
            if self.closed:
                return
            self.closed = True
            auth = _auth_by_context[id(self.context)]
            auth.allowed.by_domain.pop(self.domain, None)
            auth.authenticator.credentials_providers.pop(self.domain, None)
            auth.authenticator.passwords.pop(self.domain, None)
            auth.users -= 1
            if auth.users == 0:
                auth.authenticator.stop()
                del _auth_by_context[id(self.context)]


def admit_clients(context: Any, domain: str, security: ServerSecurity) -> Admission:
    """Start (or share) the ZAP handler of context; on domain, admit only security.admitted.

    Call before binding the socket that sets zmq.ZAP_DOMAIN to domain (a CurveZMQ server
    socket in a context without a ZAP handler admits any client key). Each serving socket
    takes its own domain, so shards of different jobs in one process never share a list."""
    if not security.admitted:
        raise errors.ConfigError(f"a {security.mechanism} server without client credentials would admit any peer")

    def configure(auth: _ContextAuth) -> None:
        auth.allowed.by_domain[domain] = frozenset(security.admitted.values())
        if security.mechanism == "plain":
            auth.authenticator.configure_plain(
                domain=domain, passwords={role: token.decode("ascii") for role, token in security.admitted.items()})
        else:
            auth.authenticator.configure_curve_callback(domain=domain, credentials_provider=auth.allowed)
    return _register(context, domain, configure)


def _register(context: Any, domain: str, configure: Callable[["_ContextAuth"], None]) -> Admission:
    with _auth_lock:
        auth = _auth_by_context.get(id(context))
        if auth is None:
            auth = _auth_by_context[id(context)] = _ContextAuth(context)
        if domain in auth.allowed.by_domain:
            raise errors.ConfigError(f"ZAP domain {domain} is already in use")
        auth.users += 1
        configure(auth)
    return Admission(context=context, domain=domain)


def bind_server(context: Any, socket: Any, address: str, *, who: str, domain: str,
                security: ServerSecurity | None) -> Admission | None:
    """Bind a serving socket; with security, admitting only its credentials (without, anyone).

    The ZAP handler is registered before the bind (see admit_clients). On failure the
    socket is closed, the admission released, and ConfigError names `who` and address."""
    import zmq

    admission = None
    try:
        if security:
            admission = admit_clients(context, domain, security)
            socket.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
            for option, value in security.options.items():
                socket.setsockopt(option, value)
        socket.bind(address)
    except (zmq.ZMQError, errors.ConfigError) as exc:
        socket.close(linger=0)
        if admission is not None:
            admission.close()
        if isinstance(exc, errors.ConfigError):
            raise
        raise errors.ConfigError(f"{who} cannot listen on {address}: {exc}") from exc
    return admission
