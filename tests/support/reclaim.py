"""What `node up` and `node addons` (../shared/kube) leave when they are SIGKILLed, taken back.

On SIGTERM each cleans up after itself. A session killed outright (every process SIGKILLed,
as when a machine's session ends) leaves its network namespaces, veth links, routes,
iptables rules, cgroups, mounts, the addons' address on lo and /run/kube-node, and the
next `node up` with the same index, or the next `node addons`, then refuses to start
("kn1 exists", "10.244.0.53 is already on lo"). NODES.md says so ("a node SIGKILLed leaves
its state") and `node leftovers` lists it; this undoes it as the node's own cleanup would.

A node counts as dead when no live `node up` holds its index in the registry; only dead
indices are touched, so a node still running (another test's) keeps all it has.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

REG = Path(os.environ.get("KUBE_NODE_RUN", "/run/kube-node"))
LINK_NET = os.environ.get("LINK_NET", "192.168.77")
ADDONS_DEFAULT_IP = "10.244.0.10"     # where `node addons` puts its DNS on lo unless told another


def sh(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def live_indices() -> set[int]:
    """The indices whose `node up` still runs (as `node`'s reg_live)."""
    live = set()
    for entry in (REG / "nodes").glob("*"):
        try:
            os.kill(int(entry.read_text().split()[0]), 0)
            live.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            pass
    return live


def left_indices() -> set[int]:
    """Every index something of a node's is still on the machine for."""
    names = sh("ip", "netns", "list").stdout + sh("ip", "-o", "link", "show").stdout
    found = {int(n) for n in re.findall(r"\b(?:kn|vkn|kbr)(\d+)\b", names)}
    found |= {int(n) for n in re.findall(r"^10\.244\.(\d+)\.0/24", sh("ip", "route").stdout, re.M)}
    found |= {int(p.name) for p in REG.glob("[0-9]*")}
    found |= {int(p.name[2:]) for h in cgroup_hierarchies() for p in h.glob("kn[0-9]*")}
    return {n for n in found if n > 0}


def cgroup_hierarchies() -> list[Path]:
    return [Path(line) for line in sh("findmnt", "-rn", "-t", "cgroup,cgroup2", "-o", "TARGET").stdout.split()]


def kill_cgroup(name: str) -> None:
    """SIGKILL what is left in cgroup NAME (pods and shims outlive a killed `node up`), then
    remove it, deepest first."""
    for _ in range(50):
        pids = {int(pid) for h in cgroup_hierarchies() for procs in (h / name).rglob("cgroup.procs")
                for pid in procs.read_text().split()}
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for h in cgroup_hierarchies():
        for folder in sorted((h / name).rglob("*/"), key=lambda p: -len(p.parts)) + [h / name]:
            if folder.is_dir():
                try:
                    folder.rmdir()
                except OSError:
                    pass


def unmount_under(*folders: Path) -> None:
    targets = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for target in sorted(targets, reverse=True):
        if any(target == str(f) or target.startswith(f"{f}/") for f in folders):
            if sh("umount", target).returncode != 0:
                sh("umount", "-l", target)


def drop_iptables_rules(pattern: str) -> None:
    """Delete every rule (of iptables and ip6tables, every table) that PATTERN matches."""
    for tool in ("iptables", "ip6tables"):
        table = ""
        for line in sh(f"{tool}-save").stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith("-A ") and re.search(pattern, line):
                sh(tool, "-w", "-t", table, "-D", *shlex.split(line)[1:])


def reclaim_node(n: int) -> None:
    kill_cgroup(f"kn{n}")
    entry = REG / "nodes" / str(n)
    fields = entry.read_text().split() if entry.exists() else []     # pid, then the node's folder
    node_dir = fields[1] if len(fields) > 1 else None
    unmount_under(REG / str(n), *([Path(node_dir)] if node_dir else []))
    sh("ip", "netns", "del", f"kn{n}")
    for link in (f"vkn{n}", f"kbr{n}"):
        sh("ip", "link", "del", link)
    sh("ip", "route", "del", f"10.244.{n}.0/24")
    drop_iptables_rules(rf"\b(vkn|kbr){n}\b|-s 10\.244\.{n}\.0/24 |-s {re.escape(LINK_NET)}\.{4 * n - 2}/32 ")
    subprocess.run(["rm", "-rf", str(REG / str(n))], check=False)
    entry.unlink(missing_ok=True)


def addons_running() -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cluster-addons.py" in b" ".join(words) or words[:1] == [b"dnsmasq"]:
            return True
    return False


def restore_machine() -> None:
    """What the first node saved of the machine, as the last node to stop restores it."""
    first = REG / "first"
    saved = first / "sysctl.saved"
    if saved.exists():
        for line in saved.read_text().splitlines():
            key, _, value = line.partition("=")
            if sh("sysctl", "-n", key).stdout.strip() != value:
                sh("sysctl", "-qw", f"{key}={value}")
    if (first / "no-run-netns").exists() and not any(Path("/run/netns").glob("*")):
        unmount_under(Path("/run/netns"))
        sh("rmdir", "/run/netns")
    if (first / "no-var-log-containers").exists():
        sh("rmdir", "/var/log/containers")
    if (first / "no-var-lib-cni").exists():
        sh("rmdir", "/var/lib/cni/results", "/var/lib/cni")
    drop_kube_proxy_chains()
    subprocess.run(["rm", "-rf", str(REG)], check=False)


def drop_kube_proxy_chains() -> None:
    """The KUBE-* and CNI-* chains a host-network node's kube-proxy and CNI made: the rules
    jumping to them, then (all flushed first, as they jump to each other) the chains."""
    drop_iptables_rules(r"-j (KUBE|CNI)-")
    for tool in ("iptables", "ip6tables"):
        chains, table = [], ""
        for line in sh(f"{tool}-save").stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif re.match(r":(KUBE|CNI)-", line):
                chains.append((table, line[1:].split()[0]))
        for flag in ("-F", "-X"):
            for table, chain in chains:
                sh(tool, "-w", "-t", table, flag, chain)


def reclaim(addons_ips: tuple[str, ...] = (ADDONS_DEFAULT_IP,)) -> list[str]:
    """Take back what dead nodes and a dead `node addons` (its DNS on one of addons_ips) left;
    what was taken back, one line each."""
    done = []
    live = live_indices()
    for n in sorted(left_indices() - live):
        reclaim_node(n)
        done.append(f"node index {n} (netns kn{n}, links, route, iptables rules, cgroup, mounts)")
    if not addons_running():
        on_lo = sh("ip", "-4", "-o", "addr", "show", "dev", "lo").stdout
        for ip in addons_ips:
            if f" {ip}/" in on_lo:
                sh("ip", "addr", "del", f"{ip}/32", "dev", "lo")
                done.append(f"address {ip} on lo")
    if not live and REG.exists():
        restore_machine()
        done.append(f"{REG} (sysctls restored as the first node found them)")
    return done
