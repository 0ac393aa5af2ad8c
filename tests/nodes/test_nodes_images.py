"""The two images `make image` built for the nodes: each at most 500 MB, on a root
filesystem with Python and the libraries it loads but no shell, no package manager and no
installer, which still records its Debian packages for image scanners (tools/image-rootfs)."""

from __future__ import annotations

import json

import pytest

from support import nodes

pytestmark = pytest.mark.timeout(600)

MAX_BYTES = 500 * 10**6   # docker's MB, as `docker image ls` shows sizes

# Run in the image (python -c): which of these paths exist, and the packages dpkg records.
INVENTORY = """
import json, os
paths = ["/bin/sh", "/bin/bash", "/usr/bin/apt-get", "/usr/bin/dpkg", "/usr/local/bin/pip",
         "/usr/local/bin/python3", "/opt/distbelief/bin/distbelief", "/etc/ssl/certs/ca-certificates.crt",
         "/usr/share/zoneinfo/UTC", "/usr/share/doc"]
packages = [line.split(":", 1)[1].strip() for line in open("/var/lib/dpkg/status") if line.startswith("Package:")]
print(json.dumps({"exists": {p: os.path.lexists(p) for p in paths}, "packages": packages}))
"""


@pytest.mark.parametrize("ref", [nodes.OPERATOR_IMAGE, nodes.RUNTIME_IMAGE])
def test_an_image_is_at_most_500_mb_and_holds_python_but_no_shell_or_installer(
        node_cluster: nodes.NodeCluster, ref: str) -> None:
    size = int(nodes.run(["docker", "image", "inspect", "-f", "{{.Size}}", ref], timeout=60).stdout)
    assert size <= MAX_BYTES, f"{ref}: {size / 1e6:.0f} MB"
    out = nodes.run(["docker", "run", "--rm", "--network", "none", "--read-only", "--entrypoint", "python", ref,
                     "-c", INVENTORY], timeout=120).stdout
    report = json.loads(out.strip().splitlines()[-1])
    exists = report["exists"]
    assert not any(exists[p] for p in ("/bin/sh", "/bin/bash", "/usr/bin/apt-get", "/usr/bin/dpkg",
                                       "/usr/local/bin/pip", "/usr/share/doc")), exists
    assert all(exists[p] for p in ("/usr/local/bin/python3", "/opt/distbelief/bin/distbelief",
                                   "/etc/ssl/certs/ca-certificates.crt", "/usr/share/zoneinfo/UTC")), exists
    assert {"libc6", "libssl3", "ca-certificates", "tzdata"} <= set(report["packages"]), report["packages"]
    assert "bash" not in report["packages"] and "dpkg" not in report["packages"]
