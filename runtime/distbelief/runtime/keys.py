"""Keys of one job: who may talk to its parameter shards, and whether the traffic is encrypted.

A job has four Curve25519 keypairs, made once when the job is created and never
rotated silently:

    server   the shards' keypair (every shard of the job uses the same one)
    client   the replicas' keypair, shared by every replica of the job
    chief    the chief's and the coordinator's (they run beside shard 0): the only key
             whose holder may end the job or drive Sandblaster's vector ops
    stage    the stages' keypair (spec.model.partitions > 1): each pod of a partitioned
             replica serves its stage to its group's other pods with it, admitting only
             the replicas' key (never the chief's: the chief never talks to a stage)

One shared replica keypair (rather than one per replica) is a deliberate choice: replicas
come and go under a Deployment and an autoscaler, so per-replica keys would need a key
authority handing them out at run time. A replica cannot be told apart from another by
its key; the shards tell connections apart by a random routing id each client keeps
(transport/zmq_link.py), which a peer cannot guess.

The keys are files in one folder (keyfiles.py: a mounted Secret on a cluster, OUTPUT/keys
in local mode); a worker's copy holds only CLIENT_FILES (and STAGE_FILES when partitioned).
The shards authenticate peers with a ZAP handler (transport/admission.py) that admits, per serving
socket, only the job's client and chief public keys, and names the peer by its key (the
ZAP User-Id) so that the shard can tell the chief apart.

Encryption is the default: CurveZMQ authenticates every connection, and a replica's
requests and the shards' replies then go sealed with AES-256-GCM under a session key
agreed over it (transport/sessions.py); the bulk port those travel on has no CurveZMQ, so the ZAP
handler admits a connection there only from an address that holds a session. With
spec.parameterServers.encryption false, sockets use
ZeroMQ's PLAIN mechanism with a token per role derived from its secret key (user
"replica" or "chief"), checked in constant time; the token and all traffic cross the
network in the clear, and a token seen there can be replayed (docs/security.md).

The operator imports this module to make a job's Secret, and must not need the runtime's
dependencies to do so at import time: zmq is imported inside the functions that use it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
from typing import Any

from distbelief.runtime import errors
from distbelief.runtime.keyfiles import (ADDED_PAIRS, CHIEF_PUBLIC, CHIEF_SECRET, CLIENT_FILES, CLIENT_PUBLIC,
                                         CLIENT_SECRET, FILES, REQUIRED_FILES, SERVER_PUBLIC, SERVER_SECRET,
                                         STAGE_FILES, STAGE_PUBLIC, STAGE_SECRET, Z85_KEY_LENGTH, check_private,
                                         read_texts, write_files)

__all__ = ["FILES", "CLIENT_FILES", "STAGE_FILES", "SERVER_PUBLIC", "SERVER_SECRET", "CLIENT_PUBLIC",
           "CLIENT_SECRET", "CHIEF_PUBLIC", "CHIEF_SECRET", "STAGE_PUBLIC", "STAGE_SECRET", "Z85_KEY_LENGTH",
           "REPLICA", "CHIEF", "JobKeys", "ServerSecurity", "ensure", "write_files"]

log = logging.getLogger(__name__)

REPLICA, CHIEF = "replica", "chief"  # the roles a client connects as (PLAIN user names)
# A PLAIN token is a keyed hash of a secret: one seen on the wire opens no encrypted transport.
PLAIN_TOKEN_KEY = b"distbelief plain transport token v1"


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """A job's keys as Z85 bytes; a key is None in a copy that lacks it (a replica's)."""

    server_public: bytes
    client_public: bytes
    chief_public: bytes | None = None
    client_secret: bytes | None = None
    server_secret: bytes | None = None
    chief_secret: bytes | None = None
    stage_public: bytes | None = None
    stage_secret: bytes | None = None

    @classmethod
    def generate(cls) -> "JobKeys":
        import zmq

        (server_public, server_secret), (client_public, client_secret), (chief_public, chief_secret), \
            (stage_public, stage_secret) = (zmq.curve_keypair() for _ in range(4))
        return cls(server_public=server_public, server_secret=server_secret, client_public=client_public,
                   client_secret=client_secret, chief_public=chief_public, chief_secret=chief_secret,
                   stage_public=stage_public, stage_secret=stage_secret)

    def _values(self) -> dict[str, bytes | None]:
        return {SERVER_PUBLIC: self.server_public, SERVER_SECRET: self.server_secret,
                CLIENT_PUBLIC: self.client_public, CLIENT_SECRET: self.client_secret,
                CHIEF_PUBLIC: self.chief_public, CHIEF_SECRET: self.chief_secret,
                STAGE_PUBLIC: self.stage_public, STAGE_SECRET: self.stage_secret}

    def files(self) -> dict[str, str]:
        """File name -> text: the folder's content, and a Secret's data."""
        return {name: value.decode("ascii") + "\n" for name, value in self._values().items() if value is not None}

    def write(self, folder: str) -> None:
        """Create folder (0700) with one 0600 file per key (see write_files)."""
        write_files(folder, self.files())

    @classmethod
    def read(cls, folder: str) -> "JobKeys | None":
        """The keys in folder; None if it holds none; ConfigError if they are incomplete or bad."""
        texts = read_texts(folder)
        if not texts:
            return None
        missing = [name for name in REQUIRED_FILES if name not in texts]
        if missing:
            raise errors.ConfigError(f"keys folder {folder} lacks {', '.join(missing)}")
        for name, text in texts.items():
            _check_z85(os.path.join(folder, name), text)
        keys = cls(server_public=texts[SERVER_PUBLIC], server_secret=texts.get(SERVER_SECRET),
                   client_public=texts[CLIENT_PUBLIC], client_secret=texts.get(CLIENT_SECRET),
                   chief_public=texts.get(CHIEF_PUBLIC), chief_secret=texts.get(CHIEF_SECRET),
                   stage_public=texts.get(STAGE_PUBLIC), stage_secret=texts.get(STAGE_SECRET))
        keys._check_pairs(folder)
        return keys

    def _check_pairs(self, folder: str) -> None:
        import zmq

        for name, public, secret in ((CLIENT_PUBLIC, self.client_public, self.client_secret),
                                     (SERVER_PUBLIC, self.server_public, self.server_secret),
                                     (CHIEF_PUBLIC, self.chief_public, self.chief_secret),
                                     (STAGE_PUBLIC, self.stage_public, self.stage_secret)):
            if secret is not None and public is not None and zmq.curve_public(secret) != public:
                raise errors.ConfigError(f"keys folder {folder}: {name} does not match its secret key")

    def server_security(self, *, encrypted: bool = True) -> "ServerSecurity":
        """How a shard's (or the coordinator's) ROUTER admits peers: CurveZMQ with the job's
        server keypair, admitting the replicas' and the chief's public keys; or PLAIN,
        admitting their tokens. Either way the chief is told apart by its ZAP User-Id."""
        import zmq

        if self.server_secret is None or self.chief_public is None:
            raise errors.ConfigError(f"the job keys have no {SERVER_SECRET} or {CHIEF_PUBLIC}: only a shard's copy does")
        if not encrypted:
            if self.client_secret is None or self.chief_secret is None:
                raise errors.ConfigError("a PLAIN server needs the replicas' and the chief's tokens")
            return ServerSecurity(mechanism="plain", options={zmq.PLAIN_SERVER: 1}, chief_user=CHIEF,
                                  admitted={REPLICA: _token(self.client_secret), CHIEF: _token(self.chief_secret)})
        return ServerSecurity(
            mechanism="curve", chief_user=self.chief_public.decode("ascii"),
            admitted={REPLICA: self.client_public, CHIEF: self.chief_public},
            options={zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: self.server_secret,
                     zmq.CURVE_PUBLICKEY: self.server_public})

    def stage_security(self, *, encrypted: bool = True) -> "ServerSecurity":
        """How a partitioned replica's stage ROUTER admits its group's other pods: CurveZMQ
        with the job's stage keypair, admitting only the replicas' public key; or PLAIN,
        admitting only the replica token. The chief is not admitted (it never talks to a
        stage), so is_chief() never holds there; chief_user is set as in server_security,
        or to the role name where a worker's copy lacks the chief's public key (a name no
        Curve User-Id can equal)."""
        import zmq

        if self.stage_secret is None or self.stage_public is None:
            raise errors.ConfigError(f"the job keys have no {STAGE_SECRET}: only a partitioned job's worker "
                                     "and shard copies do (a keys Secret made before partitions existed lacks it)")
        if not encrypted:
            return ServerSecurity(mechanism="plain", options={zmq.PLAIN_SERVER: 1}, chief_user=CHIEF,
                                  admitted={REPLICA: self.plain_token(REPLICA)})
        return ServerSecurity(
            mechanism="curve", chief_user=self.chief_public.decode("ascii") if self.chief_public else CHIEF,
            admitted={REPLICA: self.client_public},
            options={zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: self.stage_secret,
                     zmq.CURVE_PUBLICKEY: self.stage_public})

    def client_options(self, *, role: str = REPLICA, encrypted: bool = True) -> dict[int, Any]:
        """Socket options of a replica's (role REPLICA) or the chief's (CHIEF) DEALERs."""
        import zmq

        public, secret = (self.chief_public, self.chief_secret) if role == CHIEF else (
            self.client_public, self.client_secret)
        if secret is None or public is None:
            raise errors.ConfigError(f"the job keys have no {role} secret key: this pod may not act as the {role}")
        if not encrypted:
            return {zmq.PLAIN_USERNAME: role.encode(), zmq.PLAIN_PASSWORD: _token(secret)}
        return {zmq.CURVE_SERVERKEY: self.server_public, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}

    def stage_client_options(self, *, encrypted: bool = True) -> dict[int, Any]:
        """Socket options of a replica's DEALER to another pod's stage: the replica keypair,
        expecting the stage's public key (PLAIN: the replica token, as client_options)."""
        import zmq

        options = self.client_options(role=REPLICA, encrypted=encrypted)
        if not encrypted:
            return options
        if self.stage_public is None:
            raise errors.ConfigError(f"the job keys have no {STAGE_PUBLIC}: only a partitioned job's pods have it")
        return {**options, zmq.CURVE_SERVERKEY: self.stage_public}

    def plain_token(self, role: str = REPLICA) -> bytes:
        secret = self.chief_secret if role == CHIEF else self.client_secret
        if secret is None:
            raise errors.ConfigError(f"the job keys have no {role} secret key")
        return _token(secret)


def _token(secret: bytes) -> bytes:
    """A PLAIN token: a keyed hash of a secret key, never the key itself, so a token seen
    on the wire does not open the job's encrypted transport."""
    return hashlib.blake2b(secret, key=PLAIN_TOKEN_KEY, digest_size=32).hexdigest().encode()


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """A serving socket's side of the handshake: its socket options, the credentials it
    admits per role (public keys for "curve", tokens for "plain"), and the ZAP User-Id
    the chief's connections carry."""

    mechanism: str
    options: dict[int, Any]
    admitted: dict[str, bytes]
    chief_user: str

    def is_chief(self, user: str | None) -> bool:
        return user is not None and hmac.compare_digest(user.encode(), self.chief_user.encode())


def ensure(folder: str) -> JobKeys:
    """The keys in folder, generated and written there first if it holds none (local mode).

    The folder must be the user's own and closed to others: keys in a folder someone else
    can write or read are refused rather than used. A folder of an earlier version without
    the chief's or the stages' keypair gets one."""
    check_private(folder)
    texts = read_texts(folder)
    if not texts:
        keys = JobKeys.generate()
        keys.write(folder)
        log.info("event=keys_generated folder=%s", folder)
        return keys
    for pair in ADDED_PAIRS:
        if f"{pair}.public" not in texts and f"{pair}.secret" not in texts:
            write_files(folder, {name: text for name, text in JobKeys.generate().files().items()
                                 if name.startswith(pair + ".")})
            log.info("event=%s_keys_added folder=%s", pair, folder)
    keys = JobKeys.read(folder)
    assert keys is not None
    return keys


def _check_z85(path: str, text: bytes) -> None:
    from zmq.utils import z85

    try:
        valid = len(text) == Z85_KEY_LENGTH and len(z85.decode(text)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        valid = False
    if not valid:
        raise errors.ConfigError(f"job key {path} is not a {Z85_KEY_LENGTH}-character Z85 key")
