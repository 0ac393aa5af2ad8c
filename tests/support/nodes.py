"""The nodes tier's cluster (tests/nodes): the product on real nodes.

One per pytest session, from ../shared/kube (NODES.md there):

    node control-plane      etcd, kube-apiserver, controller-manager, scheduler, reachable
                            from nodes in their own network namespace and from pods
    node addons             the hostPath StorageClass `node-hostpath` (its dnsmasq stand-in
                            for DNS is moved to an unused address: CoreDNS serves the cluster)
    node up  x 3            real nodes (containerd + runc + CNI bridge + kubelet + kube-proxy):
                            node1 in this machine's network namespace, node2 in its own with
                            its link shaped to 1gbit, node3 in its own, unshaped; their
                            kubelets' clusterDNS is 10.0.0.10
    CoreDNS, metrics-server built from their released modules, packed FROM scratch, run as
                            Deployments (support/nodeaddons.py): cluster DNS at 10.0.0.10,
                            the metrics API the HPA controller reads
    the product's images    `make image` (distbelief/operator and distbelief/distbelief),
                            imported into every node (`node image-load`)

A dockerd is used if one answers, else one is started (`node docker`) and stopped at the end.
The nodes' folders (their containerd holds the imported images, about 2.7 GB each) are kept
between sessions in nodes/ under $DISTBELIEF_NODES_DIR (default /var/tmp/distbelief-nodes),
so that an image already imported (same image ID) is not imported again;
DISTBELIEF_NODES_FRESH=1 wipes them first. Each session's control plane, volumes and logs go
to a run-* folder beside them, removed at the end unless a test failed or
DISTBELIEF_NODES_KEEP=1 (its path is in the session's summary). Without CoreDNS (no Go, or
tools/fetch-go-tools fails) the dnsmasq stand-in of `node addons` serves DNS instead, and the
CoreDNS test skips (fails under CI=true).

DISTBELIEF_NODES_BUILD=0 skips `make image` and runs the images already tagged (to iterate on
the tests alone). At the end everything started is stopped (SIGTERM to each `node` command, as
`node down` sends), and `node leftovers` must list nothing that was not there before the
session began.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from support import nodeaddons, reclaim, registry
from support.registry import Registry
from support.paths import REPO

SHARED = REPO.parent / "shared" / "kube"
NODE = SHARED / "node"
BASE = Path(os.environ.get("DISTBELIEF_NODES_DIR", "/var/tmp/distbelief-nodes"))
OPERATOR_IMAGE = "distbelief/operator:0.1.0"
RUNTIME_IMAGE = "distbelief/distbelief:0.1.0"
DNS_IP = "10.0.0.10"                       # kube-system/kube-dns's ClusterIP, the kubelets' clusterDNS
STAND_IN_DNS_IP = "10.244.0.53"            # where `node addons` puts its dnsmasq, which nothing asks
# name, `node up` options
NODES = (("node1", ()), ("node2", ("--netns", "--rate", "1gbit")), ("node3", ("--netns",)))
NICE = os.environ.get("DISTBELIEF_NODES_NICE", "5")   # the nodes (so their pods), against the machine's others
BUILD_NICE = nodeaddons.BUILD_NICE
READY_SECONDS = 180.0
BUILD_SECONDS = nodeaddons.BUILD_SECONDS
LOAD_SECONDS = 1800.0

# Phase name, seconds; and what the cluster was made of: printed at the end of the session
# (tests/nodes/conftest.py).
TIMINGS: list[tuple[str, float]] = []
NOTES: list[str] = []


class Timed:
    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> "Timed":
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        TIMINGS.append((self.what + ("" if exc[0] is None else " (failed)"), time.monotonic() - self.start))


def why_unavailable() -> str | None:
    """Why the tier cannot run here, or None."""
    if not NODE.exists():
        return f"no {SHARED} beside the repository (the real-node tools: ../shared/kube/node, NODES.md)"
    if os.geteuid() != 0:
        return "the nodes tier runs real nodes (containerd, network namespaces, iptables): it needs root"
    missing = [c for c in ("docker", "containerd", "runc", "ctr", "iptables", "nsenter") if shutil.which(c) is None]
    if missing:
        return f"missing {', '.join(missing)}: `{NODE} deps` installs them"
    packages = registry.missing_packages()
    if packages:
        return f"missing Debian packages {', '.join(packages)} (the private registry): `make test-nodes` installs them"
    return None


def run(command: list[str], *, timeout: float, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    return done


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


class Daemon:
    """A blocking `node ...` command (control-plane, addons, up, docker): started in a session of
    its own, ready once DIR/READY exists; it stops what it started on SIGTERM."""

    def __init__(self, name: str, folder: Path, args: list[str], log: Path, env: dict[str, str] | None = None,
                 ) -> None:
        self.name, self.dir, self.args, self.log = name, folder, args, log
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "Daemon":
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "READY").unlink(missing_ok=True)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([str(NODE), *self.args], stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout: float = READY_SECONDS) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not (self.dir / "READY").exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"`node {' '.join(self.args)}` exited ({self.process.returncode}):\n{tail(self.log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"`node {' '.join(self.args)}` not ready in {timeout:.0f} s:\n{tail(self.log)}")
            time.sleep(0.3)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        """SIGTERM, what `node down DIR` sends (`node down` itself is not used on our own
        children: it waits while the process exists, and a child that has ended exists, as a
        zombie, until its parent reaps it: here, in wait())."""
        if self.running():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 120) -> None:
        """Wait for the end (after terminate()); SIGKILL only when it never comes."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"{self.name} did not stop within {timeout:.0f} s of SIGTERM (SIGKILLed: `node "
                               f"leftovers` tells what it left):\n{tail(self.log)}") from None
        if self.process.returncode not in (0, -signal.SIGTERM):
            raise RuntimeError(f"{self.name} ended with {self.process.returncode}:\n{tail(self.log)}")

    def stop(self, timeout: float = 120) -> None:
        self.terminate()
        self.wait(timeout)


def leftovers() -> tuple[set[str], str]:
    """`node leftovers`: its items (one per process, link, mount...; tokens of its lists) and
    its sysctls line."""
    done = run([str(NODE), "leftovers"], timeout=120, check=False)
    items, sysctls = set(), ""
    for line in done.stdout.splitlines():
        if line.startswith("sysctls now:"):
            sysctls = line
        elif line.startswith(("process ", "registry ", "address ", "/run/netns", "/var/run/docker.sock",
                              "nft tables")):
            items.add(line)
        elif ": " in line:
            kind, _, rest = line.partition(": ")
            items.update(f"{kind}: {token}" for token in rest.split())
        elif line.strip() and line.strip() != "nothing left":
            items.add(line)
    return items, sysctls


def is_dockers(item: str) -> bool:
    """A leftover of a dockerd's (its process, cgroups, mounts, a build's containers)."""
    return any(word in item for word in ("docker", "moby"))


def docker_answers() -> bool:
    return run(["docker", "info"], timeout=60, check=False).returncode == 0


def docker_image_id(ref: str) -> str | None:
    done = run(["docker", "image", "inspect", "-f", "{{.Id}}", ref], timeout=60, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def host_ip() -> str:
    """The address this machine reaches the outside with: every node reaches it, those in
    network namespaces of their own through their link (as `node` finds it)."""
    route = run(["ip", "-4", "route", "get", "1.1.1.1"], timeout=30).stdout.split()
    return route[route.index("src") + 1]


def has_make_target(target: str) -> bool:
    return run(["make", "-n", target], timeout=60, check=False, cwd=REPO).returncode == 0


def build_product_images() -> None:
    """`make image`: the operator's and the runtime's images (incremental: docker's cache)."""
    if not has_make_target("image"):
        raise RuntimeError("the Makefile has no `image` target: the nodes tier runs the images it builds "
                           f"({OPERATOR_IMAGE}, {RUNTIME_IMAGE})")
    run(["nice", "-n", BUILD_NICE, "make", "image"], timeout=BUILD_SECONDS, cwd=REPO,
        env={**os.environ, "DOCKER_BUILDKIT": "0"})
    missing = [ref for ref in (OPERATOR_IMAGE, RUNTIME_IMAGE) if docker_image_id(ref) is None]
    if missing:
        raise RuntimeError(f"`make image` made no {', '.join(missing)}")


class Node:
    def __init__(self, name: str, folder: Path, options: Iterable[str], fresh: bool) -> None:
        self.name, self.dir, self.options = name, folder, tuple(options)
        self.daemon: Daemon | None = None
        self.fresh = fresh

    def env(self) -> dict[str, str]:
        """DIR/node.env: NAME INDEX NODE_IP POD_CIDR NETNS NETNS_PATH HOST_END SOCK ..."""
        pairs = (line.partition("=") for line in (self.dir / "node.env").read_text().splitlines())
        return {k: v.strip("'\"") for k, _, v in pairs if k}

    def image_id(self, ref: str) -> str | None:
        """The config digest (docker's image ID) of ref in the node's containerd, or None."""
        sock = self.env()["SOCK"]
        ctr = ["ctr", "-a", sock, "-n", "k8s.io"]
        for name in (ref, f"docker.io/{ref}"):
            done = run([*ctr, "images", "ls", f"name=={name}"], timeout=60, check=False)
            rows = [line.split() for line in done.stdout.splitlines()[1:] if line.strip()]
            if done.returncode != 0 or not rows:
                continue
            digest = rows[0][2]
            for _ in range(3):   # an index names manifests; a manifest names its config
                content = run([*ctr, "content", "get", digest], timeout=60, check=False)
                if content.returncode != 0:
                    return None
                doc = json.loads(content.stdout)
                if "config" in doc:
                    return doc["config"]["digest"]
                if not doc.get("manifests"):
                    return None
                digest = doc["manifests"][0]["digest"]
        return None


class NodeCluster:
    """The session's cluster. Duck-types support.controlplane.ControlPlane for support.cluster's
    kubectl, api and helm fixtures: dir (the control plane's: certs/apiserver.crt), kubeconfig,
    server, admin_token, env(), has()."""

    def __init__(self, layout: Iterable[tuple[str, Iterable[str]]] = NODES) -> None:
        """layout: each node's name and `node up` options (the tier's three by default)."""
        BASE.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=BASE))
        self.run_dir.chmod(0o755)   # hostPath volumes below it are entered by the pods' uid 10001
        self.dir = self.run_dir / "control-plane"
        self.logs = self.run_dir / "logs"     # what each `node ...` printed (their own logs: DIR/logs)
        self.logs.mkdir()
        self.kubeconfig = self.dir / "kubeconfig"
        self.server = ""
        self.admin_token = ""
        fresh = os.environ.get("DISTBELIEF_NODES_FRESH") == "1"
        self.nodes = [Node(name, BASE / "nodes" / name, options, fresh) for name, options in layout]
        self.plane: Daemon | None = None
        self.addons: Daemon | None = None
        self.docker: Daemon | None = None
        self.dns = "coredns"            # or "dnsmasq" (the stand-in), when CoreDNS could not be built
        self.dns_note = ""
        self.coredns_image: str | None = None
        self.metrics_image: str | None = None   # metrics-server's, None when it could not be built
        self.metrics_note = ""
        self.registry: Registry | None = None
        self.registry_image = ""        # the runtime image, as pods pull it from the registry
        self.before: tuple[set[str], str] = (set(), "")

    # ------------------------------------------------------------ the duck type

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), **extra}

    def has(self, component: str) -> bool:
        return component != "metrics-server" or self.metrics_image is not None

    # ------------------------------------------------------------ start

    def start(self) -> "NodeCluster":
        try:
            self._start()
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def _start(self) -> None:
        self._stop_stale()
        self.before = leftovers()
        if not docker_answers():
            with Timed("docker: a dockerd of our own (`node docker`)"):
                self.docker = Daemon("dockerd", self.run_dir / "docker", ["docker", str(self.run_dir / "docker"),
                                                                          "--nice", BUILD_NICE],
                                     self.logs / "docker.out").start()
                self.docker.wait_ready()
        if os.environ.get("DISTBELIEF_NODES_BUILD") == "0":
            missing = [ref for ref in (OPERATOR_IMAGE, RUNTIME_IMAGE) if docker_image_id(ref) is None]
            if missing:
                raise RuntimeError(f"DISTBELIEF_NODES_BUILD=0, and docker has no {', '.join(missing)}")
        else:
            with Timed("images: make image"):
                build_product_images()
        with Timed("images: CoreDNS"):
            self.coredns_image, self.dns_note = nodeaddons.build_image(nodeaddons.COREDNS, self.run_dir, run)
            if self.coredns_image is None:
                self.dns = "dnsmasq"
        with Timed("images: metrics-server"):
            self.metrics_image, self.metrics_note = nodeaddons.build_image(nodeaddons.METRICS_SERVER, self.run_dir,
                                                                           run)
        with Timed("cluster up: control plane"):
            aggregation = nodeaddons.front_proxy(self.run_dir / "front-proxy", run)
            self.plane = Daemon("control plane", self.dir, ["control-plane", str(self.dir)],
                                self.logs / "control-plane.out", env={"EXTRA_APISERVER_ARGS": aggregation}).start()
            assert self.plane.process
            (self.run_dir / "control-plane.pid").write_text(str(self.plane.process.pid))
            self.plane.wait_ready()
            endpoints = dict(line.partition("=")[::2] for line in (self.dir / "endpoints.env").read_text().splitlines())
            self.server, self.admin_token = endpoints["APISERVER_URL"], endpoints["ADMIN_TOKEN"]
        with Timed("registry: docker-registry with TLS and htpasswd"):
            self.registry = Registry(self.run_dir / "registry", host_ip()).start()
        with Timed(f"cluster up: addons and {len(self.nodes)} node(s)"):
            dns_ip = STAND_IN_DNS_IP if self.dns == "coredns" else None
            self.addons = Daemon("addons", self.run_dir / "addons",
                                 ["addons", str(self.run_dir / "addons"), "--kubeconfig", str(self.kubeconfig),
                                  *(["--dns-ip", dns_ip] if dns_ip else [])], self.logs / "addons.out").start()
            for node in self.nodes:
                self._start_node(node)
            for daemon in [self.addons] + [n.daemon for n in self.nodes if n.daemon]:
                daemon.wait_ready()
        addons = [(addon, image) for addon, image in ((nodeaddons.COREDNS, self.coredns_image),
                                                      (nodeaddons.METRICS_SERVER, self.metrics_image)) if image]
        with Timed("image load"):
            self.load_images([OPERATOR_IMAGE, RUNTIME_IMAGE] + [image for _, image in addons])
        with Timed("registry: the runtime image pushed"):
            self.registry_image = self.registry.push(RUNTIME_IMAGE)
        for addon, image in addons:
            with Timed(f"add-on: {addon.name} Deployment ready"):
                self.deploy_addon(addon, image)
        if self.metrics_image:
            with Timed("add-on: the metrics API available"):
                self.kubectl("wait", "--for=condition=Available", "apiservice/v1beta1.metrics.k8s.io",
                             "--timeout=300s", timeout=330)

    def _start_node(self, node: Node, fresh: bool | None = None) -> None:
        # `node up` writes DIR/cni/net.d/10-kpod<N>.conflist for the index N it takes (the
        # first free one) but leaves those of earlier runs with other indices, and containerd
        # reads the first file: pods would get another node's pod CIDR.
        for stale in (node.dir / "cni" / "net.d").glob("*.conflist"):
            stale.unlink()
        fresh = node.fresh if fresh is None else fresh
        node_env = {"DNS_IP": DNS_IP} if self.dns == "coredns" else {}
        if self.registry:   # containerd (Go) trusts the registry's CA
            node_env["SSL_CERT_FILE"] = str(self.registry.trust_bundle)
        node.daemon = Daemon(node.name, node.dir,
                             ["up", str(node.dir), "--kubeconfig", str(self.kubeconfig), "--name", node.name,
                              "--nice", NICE, *node.options, *(["--fresh"] if fresh else [])],
                             self.logs / f"{node.name}.out", env=node_env).start()

    def stop_node(self, name: str) -> None:
        """The node lost: its kubelet, kube-proxy and containerd stop, and every container
        on it with them (`node up` ends them all on SIGTERM); its Node object stays."""
        (node,) = [n for n in self.nodes if n.name == name]
        assert node.daemon is not None
        node.daemon.stop(timeout=300)

    def start_node(self, name: str) -> None:
        """The same node back, with what its containerd held (the images): its kubelet
        registers again and runs the pods still bound to it."""
        (node,) = [n for n in self.nodes if n.name == name]
        self._start_node(node, fresh=False)
        assert node.daemon is not None
        node.daemon.wait_ready()

    def _stop_stale(self) -> None:
        """What an earlier session killed before its end left running in our folders, or left
        behind when SIGKILLed."""
        for node in self.nodes:
            pid_file = node.dir / "up.pid"
            if pid_file.exists():
                run([str(NODE), "down", str(node.dir)], timeout=300, check=False)
        for old, command in [(p, "control-plane") for p in BASE.glob("run-*/control-plane.pid")] + \
                [(p, "docker-registry") for p in BASE.glob("run-*/registry/registry.pid")]:
            try:
                pid = int(old.read_text())
                if command in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                pass
        for addons in BASE.glob("run-*/addons/up.pid"):
            run([str(NODE), "down", str(addons.parent)], timeout=120, check=False)
        # what was SIGKILLed left, or `node up` and `node addons` refuse to start
        taken_back = reclaim.reclaim(addons_ips=(reclaim.ADDONS_DEFAULT_IP, STAND_IN_DNS_IP))
        if taken_back:
            NOTES.append("taken back from a session killed before its end: " + "; ".join(taken_back))

    def load_images(self, refs: list[str]) -> None:
        """Import each image into the nodes that do not hold that very image (by ID) yet."""
        for ref in refs:
            wanted = docker_image_id(ref)
            lacking = [n for n in self.nodes if n.image_id(ref) != wanted]
            if lacking:
                started = time.monotonic()
                run(["nice", "-n", BUILD_NICE, str(NODE), "image-load", *(str(n.dir) for n in lacking), ref],
                    timeout=LOAD_SECONDS)
                TIMINGS.append((f"image load: {ref} into {len(lacking)} node(s)", time.monotonic() - started))
            else:
                TIMINGS.append((f"image load: {ref} already on the nodes", 0.0))

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True) -> str:
        binary = kubectl_binary()
        done = subprocess.run([binary, *args], input=input, capture_output=True, text=True, timeout=timeout,
                              env=self.env())
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def deploy_addon(self, addon: nodeaddons.Addon, image: str) -> None:
        self.kubectl("apply", "-f", "-", input=nodeaddons.manifests(addon, image))
        try:
            self.kubectl("-n", "kube-system", "rollout", "status", f"deployment/{addon.name}", "--timeout=300s",
                         timeout=330)
        except (RuntimeError, subprocess.TimeoutExpired):
            pods = self.kubectl("-n", "kube-system", "describe", "pods", check=False)
            logs = self.kubectl("-n", "kube-system", "logs", f"deployment/{addon.name}", "--tail=30", check=False)
            raise RuntimeError(f"{addon.name} did not become ready:\n{pods[-4000:]}\n{logs}") from None

    def summary(self) -> str:
        if self.dns == "coredns":
            dns = f"cluster DNS: {self.dns_note} at {DNS_IP}"
        else:
            dns = f"cluster DNS: the dnsmasq stand-in of `node addons` (CoreDNS: {self.dns_note})"
        metrics = self.metrics_note if self.metrics_image else f"none ({self.metrics_note})"
        return (f"nodes tier: run folder {self.run_dir}; nodes {', '.join(n.name for n in self.nodes)} "
                f"(folders under {BASE / 'nodes'}); {dns}; metrics API: {metrics}")

    # ------------------------------------------------------------ stop

    def stop(self, check: bool = True, keep: bool = False) -> None:
        """Stop everything started, in reverse order; then `node leftovers` must list nothing new.
        keep: the run folder stays (its logs)."""
        problems = []
        with Timed("teardown: nodes and addons (SIGTERM, as node down)"):
            daemons = [n.daemon for n in self.nodes if n.daemon] + ([self.addons] if self.addons else [])
            for daemon in daemons:       # all at once: each stops its own
                daemon.terminate()
            for daemon in daemons:
                try:
                    daemon.wait(timeout=300)
                except RuntimeError as exc:
                    problems.append(str(exc))
        if self.registry:
            self.registry.stop()
        with Timed("teardown: control plane (SIGTERM)"):
            if self.plane:
                try:
                    self.plane.stop()
                except RuntimeError as exc:
                    problems.append(str(exc))
        if self.docker:
            with Timed("teardown: dockerd (ours)"):
                try:
                    self.docker.stop()
                except RuntimeError as exc:
                    problems.append(str(exc))
        items, sysctls = leftovers()
        before, sysctls_before = self.before
        new = sorted(i for i in items - before if self.docker or not is_dockers(i))
        if new:
            problems.append("`node leftovers` lists what this session left:\n  " + "\n  ".join(new))
        if sysctls_before and sysctls != sysctls_before and not any(i.startswith("registry ") for i in before):
            problems.append(f"sysctls not restored:\n  before: {sysctls_before}\n  after:  {sysctls}")
        if not keep and not problems:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if problems and check:
            raise AssertionError("\n".join(problems) + f"\n(run folder kept: {self.run_dir})")


def kubectl_binary() -> str:
    from support import controlplane
    binary = controlplane.tool("kubectl")
    if binary is None:
        raise RuntimeError("no kubectl: `make kube-tools` fetches it")
    return binary
