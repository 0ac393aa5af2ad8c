"""A private image registry for the nodes tier: Debian's `docker-registry` (the CNCF
distribution registry, 2.8) run as a process of the session, serving TLS from a CA of its
own, with htpasswd authentication on. The session pushes the runtime image to it; the
nodes' containerd trusts the CA (SSL_CERT_FILE, which Go reads), so a pod pulls from it
only with a pull secret that holds the credentials.

    registry = Registry(folder, host).start()     # host: the address every node reaches
    ref = registry.push("distbelief/distbelief:0.1.0")   # "<host>:5443/distbelief/distbelief:0.1.0-<session>"
    registry.stop()
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

PORT = 5443
USER = "distbelief"
SYSTEM_CAS = Path("/etc/ssl/certs/ca-certificates.crt")
PACKAGES = {"docker-registry": "docker-registry", "htpasswd": "apache2-utils"}


def missing_packages() -> list[str]:
    """The Debian packages this needs that are not installed."""
    return [package for command, package in PACKAGES.items() if shutil.which(command) is None]


class Registry:
    def __init__(self, folder: Path, host: str) -> None:
        self.dir, self.host = folder, host
        self.password = secrets.token_urlsafe(16)
        self.session = secrets.token_hex(4)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{PORT}"

    @property
    def trust_bundle(self) -> Path:
        """The system's CA certificates and the registry's CA, for the nodes' SSL_CERT_FILE."""
        return self.dir / "ca-bundle.crt"

    def docker_config_json(self) -> str:
        """A kubernetes.io/dockerconfigjson Secret's .dockerconfigjson for this registry."""
        return json.dumps({"auths": {self.address: {"username": USER, "password": self.password}}})

    def start(self) -> "Registry":
        self.dir.mkdir(parents=True, exist_ok=True)
        self._make_certificates()
        htpasswd = subprocess.run(["htpasswd", "-Bbn", USER, self.password], capture_output=True, text=True,
                                  check=True, timeout=60).stdout
        (self.dir / "htpasswd").write_text(htpasswd)
        (self.dir / "config.yml").write_text(self._config())
        with open(self.dir / "registry.log", "ab") as log:
            self.process = subprocess.Popen(["docker-registry", "serve", str(self.dir / "config.yml")], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        (self.dir / "registry.pid").write_text(str(self.process.pid))   # for a later session, if this one is killed
        self._wait_ready()
        return self

    def push(self, ref: str) -> str:
        """Push a copy of a docker image to the registry (docker reaches it on 127.0.0.1,
        which docker takes for an insecure registry) and return the reference the nodes pull
        it by. The copy is another image (one label more): the kubelet (1.36, KEP-2535)
        records which pull secrets an image ID was pulled with, and from then on it makes
        every pod of that image ID, whatever name it uses, pull it again with credentials.
        The same image would send the other tests' pods, imported with `node image-load`,
        to docker.io. Its tag is new at each session, so that no node has it yet (the
        nodes keep their images between sessions) and each pod pulls it."""
        repository, _, tag = ref.rpartition(":")
        ref_here = f"{repository}:{tag}-{self.session}"
        local = f"127.0.0.1:{PORT}/{ref_here}"
        env = {**os.environ, "DOCKER_CONFIG": str(self.dir / "docker")}
        subprocess.run(["docker", "login", "--username", USER, "--password-stdin", f"127.0.0.1:{PORT}"],
                       input=self.password, capture_output=True, text=True, check=True, timeout=120, env=env)
        subprocess.run(["docker", "build", "--quiet", "--tag", local, "-"],
                       input=f"FROM {ref}\nLABEL io.distbelief.test.registry-copy=true\n", capture_output=True,
                       text=True, check=True, timeout=300, env={**env, "DOCKER_BUILDKIT": "0"})
        try:
            subprocess.run(["docker", "push", "--quiet", local], capture_output=True, check=True, timeout=900, env=env)
        finally:
            subprocess.run(["docker", "rmi", local], capture_output=True, timeout=60)
        return f"{self.address}/{ref_here}"

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _make_certificates(self) -> None:
        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], capture_output=True, check=True, timeout=120, cwd=self.dir)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=distbelief test registry CA",
                "-keyout", "ca.key", "-out", "ca.crt")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=registry", "-keyout", "registry.key",
                "-out", "registry.csr")
        (self.dir / "san.ext").write_text(f"subjectAltName=IP:{self.host},IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", "registry.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", "san.ext", "-out", "registry.crt")
        self.trust_bundle.write_text(SYSTEM_CAS.read_text() + (self.dir / "ca.crt").read_text())

    def _config(self) -> str:
        return f"""version: 0.1
log: {{level: warn}}
storage:
  filesystem: {{rootdirectory: {self.dir / "data"}}}
  delete: {{enabled: true}}
http:
  addr: 0.0.0.0:{PORT}
  tls: {{certificate: {self.dir / "registry.crt"}, key: {self.dir / "registry.key"}}}
auth:
  htpasswd: {{realm: distbelief-test, path: {self.dir / "htpasswd"}}}
"""

    def _wait_ready(self, timeout: float = 60) -> None:
        """Until /v2/ answers 401: serving TLS, and asking for credentials."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
                                   str(self.dir / "ca.crt"), f"https://127.0.0.1:{PORT}/v2/"],
                                  capture_output=True, text=True, timeout=30)
            if done.stdout == "401":
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "registry.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"docker-registry not serving on :{PORT} (last answer {done.stdout!r}):\n{log}")
            time.sleep(0.3)
