"""The nodes tier's cluster add-ons, built from their released Go modules (tools/fetch-go-tools)
into FROM scratch images and run as clusters run them, each a Deployment in kube-system:

    CoreDNS          cluster DNS behind kube-system/kube-dns at 10.0.0.10 (tests/nodes/coredns.yaml)
    metrics-server   the resource metrics API (metrics.k8s.io) that the HPA controller reads,
                     behind the APIService v1beta1.metrics.k8s.io (tests/nodes/metrics-server.yaml)
    prometheus-adapter  the custom metrics API (custom.metrics.k8s.io), for the one test
                     that autoscales on a job's own signal (support/custommetrics.py)

The aggregation layer needs the API server to hold a front-proxy client certificate, and
(its Service's ClusterIP is not routable from the API server's loopback) to reach the pod
at its endpoint: front_proxy() makes the certificates and the API server's flags.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from support.paths import REPO, TESTS

BUILD_SECONDS = 3600.0
BUILD_NICE = "10"


@dataclasses.dataclass(frozen=True)
class Addon:
    name: str             # tools/fetch-go-tools's name, the Deployment's (and the binary's)
    ports: str            # the image's EXPOSE line
    manifests: Path
    placeholder: str      # replaced in manifests by the image's reference
    binary: str = ""      # the command's name, when not the add-on's


COREDNS = Addon("coredns", "53 53/udp 9153", TESTS / "nodes" / "coredns.yaml", "__COREDNS_IMAGE__")
METRICS_SERVER = Addon("metrics-server", "10250", TESTS / "nodes" / "metrics-server.yaml",
                       "__METRICS_SERVER_IMAGE__")
PROMETHEUS_ADAPTER = Addon("prometheus-adapter", "6443", TESTS / "nodes" / "prometheus-adapter.yaml",
                           "__PROMETHEUS_ADAPTER_IMAGE__", binary="adapter")

Run = Callable[..., subprocess.CompletedProcess]


def build_image(addon: Addon, workdir: Path, run: Run) -> tuple[str | None, str]:
    """The add-on in a FROM scratch image: (its reference, how it was made), or (None, why not)."""
    tool = REPO / "tools" / "fetch-go-tools"
    try:
        done = run([str(tool), addon.name], timeout=BUILD_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return None, f"tools/fetch-go-tools {addon.name} did not finish in {BUILD_SECONDS:.0f} s"
    if done.returncode != 0:
        return None, f"tools/fetch-go-tools {addon.name} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}"
    bin_dir = Path(done.stdout.strip().splitlines()[-1])
    version = bin_dir.parent.name.removeprefix(f"{addon.name}-")         # <cache>/<name>-<version>/bin
    ref = f"distbelief-test/{addon.name}:{version}"
    context = Path(tempfile.mkdtemp(prefix=f"{addon.name}-image.", dir=workdir))
    try:
        binary = addon.binary or addon.name
        shutil.copy2(bin_dir / binary, context / binary)
        (context / "Dockerfile").write_text(
            "FROM scratch\n"
            f"COPY {binary} /{binary}\n"
            f"EXPOSE {addon.ports}\n"
            f'ENTRYPOINT ["/{binary}"]\n')
        run(["nice", "-n", BUILD_NICE, "docker", "build", "--network", "host", "-q", "-t", ref, str(context)],
            timeout=600, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    finally:
        shutil.rmtree(context, ignore_errors=True)
    return ref, f"{addon.name} {version} ({bin_dir / (addon.binary or addon.name)})"


def manifests(addon: Addon, image: str) -> str:
    return addon.manifests.read_text().replace(addon.placeholder, image)


def front_proxy(folder: Path, run: Run) -> str:
    """A front-proxy CA and its client certificate in folder (openssl), and the API server
    flags that make it the aggregation layer's client and route to endpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, client = folder / "front-proxy-ca", folder / "front-proxy-client"
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=front-proxy-ca",
         "-keyout", f"{ca}.key", "-out", f"{ca}.crt"], timeout=120)
    run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=front-proxy-client",
         "-keyout", f"{client}.key", "-out", f"{client}.csr"], timeout=120)
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    run(["openssl", "x509", "-req", "-in", f"{client}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
         "-CAcreateserial", "-days", "2", "-extfile", str(folder / "client.ext"), "-out", f"{client}.crt"],
        timeout=120)
    return " ".join([
        f"--requestheader-client-ca-file={ca}.crt", "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={client}.crt", f"--proxy-client-key-file={client}.key",
        "--enable-aggregator-routing=true"])
