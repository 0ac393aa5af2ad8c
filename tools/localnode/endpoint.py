"""The agent's HTTP(S) endpoint, on 127.0.0.1 and the port the Node advertises as its
kubelet endpoint (status.daemonEndpoints):

    GET /containerLogs/NS/POD/CONTAINER[?follow&tailLines&limitBytes]   the container's log
                   (logs.py): the kubelet's path, which the API server calls for `kubectl logs`
    GET /api/v1/namespaces/NS/pods/POD:PORT/proxy/PATH   GET http://<POD's IP>:PORT/PATH, answered
                   as the pod answers: pods by name for a client off the pod network (the
                   API server's own pod proxy refuses loopback pod IPs)
    GET /healthz   ok

The operator run off the cluster reads the chief's metrics through it, with
DISTBELIEF_METRICS_URL=http://127.0.0.1:PORT/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/metrics.
One port answers plain HTTP and TLS alike (the first byte of a connection tells which): the
API server speaks only HTTPS to a kubelet, and skips verifying the certificate when it is
given no kubelet CA, as here; the agent makes a self-signed one at start.
"""

from __future__ import annotations

import datetime
import http.client
import http.server
import ipaddress
import logging
import os
import re
import socket
import ssl
import threading
import urllib.parse
from typing import Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from localnode import logs
from localnode.addresses import HOST_IP, PodNetwork

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 10.0
MAX_BODY_BYTES = 16 << 20
TLS_RECORD = b"\x16"   # a TLS handshake's first byte
_POD_PROXY = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/:]+):(\d+)/proxy(/.*)?$")
_LOGS = re.compile(r"^/containerLogs/([^/]+)/([^/]+)/([^/]+)$")
LogFinder = Callable[[str, str, str], "logs.LogSource | None"]


class Endpoint:
    """The server in a thread of its own; port is where it listens."""

    def __init__(self, network: PodNetwork, find_log: LogFinder, folder: str, port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"network": network, "find_log": staticmethod(find_log)})
        self.server = _Server((HOST_IP, port), handler)
        self.server.tls = _tls_context(folder)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="node-endpoint", daemon=True)

    def start(self) -> "Endpoint":
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext

    def finish_request(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        request.settimeout(TIMEOUT_SECONDS)
        try:
            if request.recv(1, socket.MSG_PEEK) == TLS_RECORD:
                request = self.tls.wrap_socket(request, server_side=True)
            request.settimeout(None)
            self.RequestHandlerClass(request, client_address, self)
        except OSError as exc:  # a client that went away, or a failed handshake
            log.debug("event=endpoint_connection_failed error=%s", exc)


class _Handler(http.server.BaseHTTPRequestHandler):
    network: PodNetwork
    find_log: LogFinder
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("event=endpoint_request " + format, *args)

    def do_GET(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        if parts.path == "/healthz":
            return self._answer(200, b"ok")
        found = _POD_PROXY.match(parts.path)
        if found:
            namespace, pod, port, rest = found.groups()
            target = (rest or "/") + (f"?{parts.query}" if parts.query else "")
            return self._forward(self.network.ip(namespace, pod), int(port), target)
        found = _LOGS.match(parts.path)
        if found:
            return self._logs(*found.groups(), query=dict(urllib.parse.parse_qsl(parts.query)))
        self._answer(404, b"not found")

    def _forward(self, ip: str, port: int, target: str) -> None:
        connection = http.client.HTTPConnection(ip, port, timeout=TIMEOUT_SECONDS)
        try:
            connection.request("GET", target)
            response = connection.getresponse()
            body = response.read(MAX_BODY_BYTES + 1)
        except OSError as exc:
            return self._answer(502, f"pod at {ip}:{port} did not answer: {exc}".encode())
        finally:
            connection.close()
        if len(body) > MAX_BODY_BYTES:
            return self._answer(502, b"answer too large")
        self._answer(response.status, body, response.getheader("Content-Type") or "text/plain")

    def _logs(self, namespace: str, pod: str, container: str, *, query: dict[str, str]) -> None:
        source = self.find_log(namespace, pod, container)
        if source is None:
            return self._answer(404, f"no log of container {container} of pod {namespace}/{pod}".encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()

        def write(data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        try:
            logs.serve(source, query, write)
        except OSError:  # the client went away (or the log did)
            pass

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _tls_context(folder: str) -> ssl.SSLContext:
    """A server context with a fresh self-signed certificate for 127.0.0.1 (files in folder)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "local-node")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=365))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST_IP))]),
                                  critical=False)
                   .sign(key, hashes.SHA256()))
    os.makedirs(folder, exist_ok=True)
    cert_path, key_path = os.path.join(folder, "endpoint.crt"), os.path.join(folder, "endpoint.key")
    with open(cert_path, "wb") as f:
        f.write(certificate.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    return context
