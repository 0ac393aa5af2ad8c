"""Keys of one job: who may talk to its parameter shards, and whether the traffic is encrypted.

A job has two Curve25519 keypairs, made once when the job is created and never rotated
silently:

    server   the shards' keypair (every shard of the job uses the same one)
    client   one keypair shared by every replica and by the chief of the job

One shared client keypair (rather than one per replica) is a deliberate choice: replicas
come and go under a Deployment and an autoscaler, so per-replica keys would need a key
authority handing them out at run time. What the shards check is "holds this job's
client key", which is what the threat model needs (docs/security.md): a peer without it
can neither pull nor push. A replica cannot be told apart from another by its key.

The keys are files in one folder (a mounted Secret on a cluster, OUTPUT/keys in local
mode), each the 40-character Z85 text of one 32-byte key and a newline, mode 0600:

    server.public  server.secret  client.public  client.secret

A worker's copy may lack server.secret (the renderer mounts only what a role needs).
The shards authenticate clients with a ZAP handler (pyzmq's ThreadAuthenticator, one
per ZeroMQ context, shared by the shards of that context) that admits, per shard
socket's ZAP domain, only the job's client public key; a peer that knows the server's
public key but not the client secret fails the handshake and gets nothing back.

Encryption is the default: CurveZMQ authenticates and encrypts every message. A job with
spec.parameterServers.encryption false trades the encryption for speed (on 2 cores the
cipher takes most of a large model's step): its sockets use ZeroMQ's PLAIN mechanism with
a token derived from the client secret key, so only key holders still get in, but the
token and all traffic cross the network in the clear (docs/security.md says what that
leaves open).

The operator imports this module to make a job's Secret, and must not need the runtime's
dependencies to do so at import time: zmq is imported inside the functions that use it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import Any

from distbelief.runtime import errors

log = logging.getLogger(__name__)

SERVER_PUBLIC = "server.public"
SERVER_SECRET = "server.secret"
CLIENT_PUBLIC = "client.public"
CLIENT_SECRET = "client.secret"
FILES = (SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC, CLIENT_SECRET)
# What a replica needs: it never serves, so it never holds the server's secret.
CLIENT_FILES = (SERVER_PUBLIC, CLIENT_PUBLIC, CLIENT_SECRET)
Z85_KEY_LENGTH = 40
PLAIN_USERNAME = "distbelief"
# A PLAIN token is a keyed hash of the client secret, never the secret itself: a token
# seen on the wire does not open the job's encrypted transport.
PLAIN_TOKEN_KEY = b"distbelief plain transport token v1"
FILE_MODE = 0o600
FOLDER_MODE = 0o700


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """A job's keys as Z85 bytes; server_secret is None in a replica's copy."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None

    @classmethod
    def generate(cls) -> "JobKeys":
        import zmq

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public=server_public, server_secret=server_secret,
                   client_public=client_public, client_secret=client_secret)

    def files(self) -> dict[str, str]:
        """File name -> text: the folder's content, and a Secret's data."""
        values = {SERVER_PUBLIC: self.server_public, SERVER_SECRET: self.server_secret,
                  CLIENT_PUBLIC: self.client_public, CLIENT_SECRET: self.client_secret}
        return {name: value.decode("ascii") + "\n" for name, value in values.items() if value is not None}

    def write(self, folder: str) -> None:
        """Create folder (0700) with one 0600 file per key; never overwrites a key file."""
        try:
            os.makedirs(folder, mode=FOLDER_MODE, exist_ok=True)
            os.chmod(folder, FOLDER_MODE)
            for name, text in self.files().items():
                fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
                with os.fdopen(fd, "w", encoding="ascii") as f:
                    f.write(text)
        except OSError as exc:
            raise errors.ConfigError(f"cannot write job keys into {folder}: {exc.strerror or exc}") from exc

    @classmethod
    def read(cls, folder: str) -> "JobKeys | None":
        """The keys in folder; None if it holds none; ConfigError if they are incomplete or bad."""
        texts: dict[str, bytes] = {}
        for name in FILES:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    texts[name] = f.read(4 * Z85_KEY_LENGTH).strip()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise errors.ConfigError(f"cannot read job key {path}: {exc.strerror or exc}") from exc
        if not texts:
            return None
        missing = [name for name in CLIENT_FILES if name not in texts]
        if missing:
            raise errors.ConfigError(f"keys folder {folder} lacks {', '.join(missing)}")
        for name, text in texts.items():
            _check_z85(os.path.join(folder, name), text)
        keys = cls(server_public=texts[SERVER_PUBLIC], server_secret=texts.get(SERVER_SECRET),
                   client_public=texts[CLIENT_PUBLIC], client_secret=texts[CLIENT_SECRET])
        keys._check_pairs(folder)
        return keys

    def _check_pairs(self, folder: str) -> None:
        import zmq

        pairs = [(CLIENT_PUBLIC, self.client_public, self.client_secret)]
        if self.server_secret is not None:
            pairs.append((SERVER_PUBLIC, self.server_public, self.server_secret))
        for name, public, secret in pairs:
            if zmq.curve_public(secret) != public:
                raise errors.ConfigError(f"keys folder {folder}: {name} does not match its secret key")

    def server_security(self, *, encrypted: bool = True) -> "ServerSecurity":
        """How a shard's (or the coordinator's) ROUTER admits peers: CurveZMQ with the
        job's server keypair, admitting the client public key; or PLAIN, admitting the token."""
        import zmq

        if self.server_secret is None:
            raise errors.ConfigError(f"the job keys have no {SERVER_SECRET}: only a shard's copy does")
        if not encrypted:
            return ServerSecurity(mechanism="plain", options={zmq.PLAIN_SERVER: 1},
                                  admitted=frozenset({self.plain_token()}))
        return ServerSecurity(mechanism="curve", admitted=frozenset({self.client_public}), options={
            zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: self.server_secret, zmq.CURVE_PUBLICKEY: self.server_public})

    def client_options(self, *, encrypted: bool = True) -> dict[int, Any]:
        """Socket options of a replica's (or the chief's) DEALERs."""
        import zmq

        if not encrypted:
            return {zmq.PLAIN_USERNAME: PLAIN_USERNAME.encode(), zmq.PLAIN_PASSWORD: self.plain_token()}
        return {zmq.CURVE_SERVERKEY: self.server_public, zmq.CURVE_PUBLICKEY: self.client_public,
                zmq.CURVE_SECRETKEY: self.client_secret}

    def plain_token(self) -> bytes:
        return hashlib.blake2b(self.client_secret, key=PLAIN_TOKEN_KEY, digest_size=32).hexdigest().encode()


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """A serving socket's side of the handshake: its socket options, and what the ZAP
    handler admits (client public keys for "curve", tokens for "plain")."""

    mechanism: str
    options: dict[int, Any]
    admitted: frozenset[bytes]


def ensure(folder: str) -> JobKeys:
    """The keys in folder, generated and written there first if it holds none (local mode)."""
    keys = JobKeys.read(folder)
    if keys is None:
        keys = JobKeys.generate()
        keys.write(folder)
        log.info("event=keys_generated folder=%s", folder)
    return keys


def _check_z85(path: str, text: bytes) -> None:
    from zmq.utils import z85

    try:
        valid = len(text) == Z85_KEY_LENGTH and len(z85.decode(text)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        valid = False
    if not valid:
        raise errors.ConfigError(f"job key {path} is not a {Z85_KEY_LENGTH}-character Z85 key")


# -- the shards' side: a ZAP handler that admits only the job's client key ------------


REFUSAL_LOG_SECONDS = 10.0  # at most one refusal line per domain this often (a peer may retry fast)


class _Allowed:
    """ThreadAuthenticator credentials provider: ZAP domain -> admitted client keys."""

    def __init__(self) -> None:
        self.by_domain: dict[str, frozenset[bytes]] = {}
        self._refusals: dict[str, tuple[float, int]] = {}  # domain -> (last logged, since then)

    def callback(self, domain: str, key: bytes) -> bool:
        admitted = key in self.by_domain.get(domain, frozenset())
        if not admitted:
            self._log_refusal(domain)
        return admitted

    def _log_refusal(self, domain: str) -> None:
        now = time.monotonic()
        last, count = self._refusals.get(domain, (float("-inf"), 0))
        if now - last >= REFUSAL_LOG_SECONDS:
            log.warning("event=peer_refused domain=%s reason=unknown_client_key refused=%d", domain, count + 1)
            self._refusals[domain] = (now, 0)
        else:
            self._refusals[domain] = (last, count + 1)


class _ContextAuth:
    def __init__(self, context: Any) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.allowed = _Allowed()
        zap_log = logging.getLogger(__name__ + ".zap")
        zap_log.setLevel(logging.INFO)  # never debug: pyzmq logs PLAIN passwords (our join tokens) there
        self.authenticator = ThreadAuthenticator(context, log=zap_log)
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
    with _auth_lock:
        auth = _auth_by_context.get(id(context))
        if auth is None:
            auth = _auth_by_context[id(context)] = _ContextAuth(context)
        if domain in auth.allowed.by_domain:
            raise errors.ConfigError(f"ZAP domain {domain} is already in use")
        auth.users += 1
        auth.allowed.by_domain[domain] = frozenset(security.admitted)
        if security.mechanism == "plain":
            [token] = security.admitted
            auth.authenticator.configure_plain(domain=domain, passwords={PLAIN_USERNAME: token.decode("ascii")})
        else:
            auth.authenticator.configure_curve_callback(domain=domain, credentials_provider=auth.allowed)
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
