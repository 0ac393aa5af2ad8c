"""The Helm chart (charts/distbelief), checked with the real helm binary.

* ``helm lint --strict`` and the values schema;
* ``helm template`` output against the Kubernetes 1.30 OpenAPI schemas, strictly;
* the chart's CRD is the file in crds/ (a symlink, and what ``helm package`` ships);
* the operator's RBAC rules: no wildcard, Secrets only created, a Role per watched
  namespace (that the rules are exactly the calls the operator makes is checked on a real
  API server, tests/cluster/test_cluster_rbac.py);
* checkov on the rendered chart and on the children ``distbelief render`` prints: every
  failed check is one the docs list with its reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from distbelief.operator.render import context, podparts, render
from distbelief.operator.validation.job import DistBeliefJob
from support.chartdocs import of_kind, operator_container, operator_deployment, operator_grants
from support.cli import run_cli
from support.examples import load_example
from support.paths import REPO

CHART = REPO / "charts" / "distbelief"
CRD_FILE = REPO / "crds" / "distbelief.io_distbeliefjobs.yaml"
DOCS = REPO / "docs" / "install.md"
RELEASE, NAMESPACE = "distbelief", "distbelief-system"
K8S_VERSION = "1.30"


def _tool(name: str, *fallbacks: Path) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    return next((str(p) for p in fallbacks if os.access(p, os.X_OK)), None)


HELM = _tool("helm", REPO / ".cache" / "kube-tools" / "bin" / "helm")
CHECKOV = _tool("checkov", REPO / ".cache" / "checkov" / "bin" / "checkov", REPO / ".venv" / "bin" / "checkov")

pytestmark = pytest.mark.skipif(HELM is None, reason="helm not found: tools/fetch-kube-tools fetches it")

# Values the tests render the chart with: the defaults, a namespaced install, and every
# option set at once.
DIGEST = "sha256:" + "0123456789abcdef" * 4
VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"operator": {"watchNamespaces": ["ml", "research"]}},
    "standalone": {"peering": {"enabled": False}, "networkPolicy": {"enabled": False},
                   "rbac": {"aggregateToDefaultRoles": False}},
    "everything": {
        "image": {"repository": "registry.example:5000/ml/distbelief", "digest": DIGEST, "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "registry"}],
        "runtimeImage": "registry.example:5000/ml/distbelief-gpu:0.1.0",
        "operator": {"watchNamespaces": ["ml"], "statusInterval": 2, "handlerThreads": 64,
                     "metricsURL": "http://{pod}.{service}.{namespace}.svc.cluster.local:{port}/metrics",
                     "logLevel": "debug", "podAnnotations": {"example.org/team": "ml"},
                     "podLabels": {"team": "ml"}, "nodeSelector": {"kubernetes.io/os": "linux"},
                     "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
                     "priorityClassName": "ml-critical"},
        "peering": {"name": "distbelief-ml"},
        "serviceAccount": {"annotations": {"example.org/role": "operator"}},
        "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                    "podMonitor": {"enabled": True, "interval": "15s"},
                    "operator": {"enabled": True, "port": 9200},
                    "dashboard": {"enabled": True, "namespace": "monitoring",
                                  "annotations": {"grafana_folder": "DistBelief"}}},
    },
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """helm, with its notice about the symlinked CRD (stderr) left out of the way."""
    assert HELM is not None
    done = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)
    if check:
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
    return done


def _values_file(folder: Path, name: str) -> Path:
    path = folder / f"values-{name}.yaml"
    path.write_text(yaml.safe_dump(VALUES[name]))
    return path


@pytest.fixture(scope="module")
def values_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("values")
    for name in VALUES:
        _values_file(folder, name)
    return folder


def template(values_dir: Path, name: str, *extra: str) -> list[dict[str, Any]]:
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", K8S_VERSION,
               "-f", str(values_dir / f"values-{name}.yaml"), *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# ------------------------------------------------------------------ lint, schemas


@pytest.mark.parametrize("name", list(VALUES))
def test_helm_lint_strict(values_dir: Path, name: str) -> None:
    done = helm("lint", "--strict", str(CHART), "-f", str(values_dir / f"values-{name}.yaml"))
    assert "0 chart(s) failed" in done.stdout, done.stdout


@pytest.mark.parametrize("name", list(VALUES))
def test_rendered_chart_passes_the_kubernetes_schemas(values_dir: Path, name: str) -> None:
    docs = template(values_dir, name, "--include-crds")
    custom = {"ClusterKopfPeering", "KopfPeering", "ServiceMonitor", "PodMonitor"}
    for doc in docs:
        if doc["kind"] not in custom:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"} <= kinds
    assert kinds - custom <= {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                              "Role", "RoleBinding", "Deployment", "NetworkPolicy", "Service", "ConfigMap"}


def test_peering_objects_fit_the_chart_crds_and_the_mode(values_dir: Path) -> None:
    crds = {c["spec"]["names"]["kind"]: c for c in yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml")
                                                                      .read_text())}
    (cluster,) = of_kind(template(values_dir, "defaults"), "ClusterKopfPeering")
    assert cluster["apiVersion"] == "kopf.dev/v1" and "namespace" not in cluster["metadata"]
    assert cluster["metadata"]["name"] == "distbelief"
    namespaced = of_kind(template(values_dir, "namespaced"), "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in namespaced) == ["ml", "research"]
    assert not of_kind(template(values_dir, "namespaced"), "ClusterKopfPeering")
    assert not [d for d in template(values_dir, "standalone") if d["kind"].endswith("KopfPeering")]
    assert crds["ClusterKopfPeering"]["spec"]["scope"] == "Cluster"
    assert crds["KopfPeering"]["spec"]["scope"] == "Namespaced"


def test_kopf_peering_crds_are_the_types_kopf_uses() -> None:
    """Same names, groups and scopes as kopf's own references, and no status subresource:
    kopf writes .status through the main endpoint (the cluster tests run kopf's peering on
    these CRDs, installed by helm)."""
    from kopf._cogs.structs import references

    ours = {c["metadata"]["name"]: c for c in yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text())}
    for selector in (references.CLUSTER_PEERINGS_K, references.NAMESPACED_PEERINGS_K):
        assert (selector.group, selector.version) == ("kopf.dev", "v1")
        assert f"{selector.any_name}.{selector.group}" in ours
    scopes = {references.CLUSTER_PEERINGS_K: "Cluster", references.NAMESPACED_PEERINGS_K: "Namespaced"}
    for selector, scope in scopes.items():
        crd = ours[f"{selector.any_name}.{selector.group}"]
        assert crd["spec"]["scope"] == scope
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1" and "subresources" not in version
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values, message", [
    (["operator.replicas=2"], "/operator/replicas"),
    (["operator.securityContext.readOnlyRootFilesystem=false"], "readOnlyRootFilesystem"),
    (["operator.podSecurityContext.runAsNonRoot=false"], "runAsNonRoot"),
    (["operator.watchNamespaces={Not_A_Namespace}"], "/operator/watchNamespaces/0"),
    (["image.digest=latest"], "/image/digest"),
    (["operatr.replicas=1"], "operatr"),
])
def test_values_schema_refuses_typos_and_weakened_pods(values: list[str], message: str) -> None:
    args = [a for v in values for a in ("--set", v)]
    done = helm("template", RELEASE, str(CHART), *args, check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


# ------------------------------------------------------------------ the CRD


def test_the_chart_crd_is_the_file_in_crds(tmp_path: Path) -> None:
    link = CHART / "crds" / CRD_FILE.name
    assert link.is_symlink(), f"{link} must be a symlink to {CRD_FILE}, not a copy that can drift"
    assert link.resolve() == CRD_FILE.resolve()
    # What helm installs, and what a packaged chart carries: the file's own bytes.
    shown = helm("show", "crds", str(CHART)).stdout
    assert CRD_FILE.read_text() in shown
    helm("package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("distbelief-*.tgz")
    with tarfile.open(package) as tar:
        member = tar.extractfile(f"distbelief/crds/{CRD_FILE.name}")
        assert member is not None and member.read() == CRD_FILE.read_bytes()
        crds = sorted(n for n in tar.getnames() if n.startswith("distbelief/crds/"))
    assert crds == [f"distbelief/crds/{CRD_FILE.name}", "distbelief/crds/kopf.dev_peerings.yaml"]


# ------------------------------------------------------------------ the operator's pod


def test_operator_deployment(values_dir: Path) -> None:
    docs = template(values_dir, "defaults")
    deployment = operator_deployment(docs)
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(docs)
    (sa,) = of_kind(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True and sa["automountServiceAccountToken"] is False
    assert container["image"] == f"distbelief/operator:{chart_meta()['appVersion']}"
    assert container["args"] == ["--log-level=info", "operator", "--peering=distbelief",
                                 "--liveness=http://0.0.0.0:8080/healthz"]
    (port,) = container["ports"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert port["containerPort"] == 8080
    assert set(container["resources"]) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) & set(container["resources"]["limits"])
    env = env_of(container)
    assert env["DISTBELIEF_RUNTIME_IMAGE"] == f"distbelief/distbelief:{chart_meta()['appVersion']}"  # the runtime image
    assert env["DISTBELIEF_STATUS_INTERVAL"] == "5"
    assert env["DISTBELIEF_HANDLER_THREADS"] == "32"
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The jobs' NetworkPolicies admit the operator from the namespace it really runs in.
    assert env["DISTBELIEF_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert "DISTBELIEF_METRICS_URL" not in env


def test_operator_arguments_follow_the_values(values_dir: Path) -> None:
    container = operator_container(template(values_dir, "everything"))
    assert container["args"] == ["--log-level=debug", "operator", "--namespace=ml", "--peering=distbelief-ml",
                                 "--liveness=http://0.0.0.0:8080/healthz", "--metrics=0.0.0.0:9200"]
    assert container["image"] == f"registry.example:5000/ml/distbelief@{DIGEST}"
    env = env_of(container)
    assert env["DISTBELIEF_RUNTIME_IMAGE"] == "registry.example:5000/ml/distbelief-gpu:0.1.0"
    assert env["DISTBELIEF_METRICS_URL"] == VALUES["everything"]["operator"]["metricsURL"]
    assert env["DISTBELIEF_STATUS_INTERVAL"] == "2"
    assert env["DISTBELIEF_HANDLER_THREADS"] == "64"
    standalone = operator_container(template(values_dir, "standalone"))
    assert "--standalone" in standalone["args"] and not any(a.startswith("--peering") for a in standalone["args"])
    # The operator's own CLI accepts exactly these arguments.
    from distbelief.operator import cli

    for args in (container["args"], standalone["args"]):
        parsed = cli._parser().parse_args(args)
        assert parsed.func is cli._operator
    assert cli._parser().parse_args(container["args"]).metrics == ("0.0.0.0", 9200)
    assert cli._parser().parse_args(standalone["args"]).metrics is None


def chart_meta() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def test_runtime_image_defaults_to_the_renderers_default(values_dir: Path) -> None:
    """The chart's default runtime image is the one the renderer falls back to, so
    `distbelief render` shows what a default install runs."""
    env = env_of(operator_container(template(values_dir, "defaults")))
    assert env["DISTBELIEF_RUNTIME_IMAGE"] == context.DEFAULT_IMAGE


@pytest.mark.parametrize("name", list(VALUES))
def test_operator_pod_is_hardened(values_dir: Path, name: str) -> None:
    pod = operator_deployment(template(values_dir, name))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsUser"] == podparts.RUN_AS_ID  # the image's user, as for job pods
    (container,) = pod["containers"]
    hardening = container["securityContext"]
    assert hardening["allowPrivilegeEscalation"] is False
    assert hardening["readOnlyRootFilesystem"] is True
    assert hardening["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_network_policy_admits_nothing_to_the_operator(values_dir: Path) -> None:
    docs = template(values_dir, "defaults")
    (policy,) = of_kind(docs, "NetworkPolicy")
    labels = operator_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"] == []
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_monitors_select_the_jobs_metrics_ports(values_dir: Path) -> None:
    """The ServiceMonitor's selector and port match the headless Service the renderer
    makes for every job, the PodMonitor's its worker pods."""
    docs = template(values_dir, "everything")
    (service_monitor,) = [m for m in of_kind(docs, "ServiceMonitor") if m["metadata"]["name"].endswith("-shards")]
    (pod_monitor,) = of_kind(docs, "PodMonitor")
    children = {c["kind"]: c for c in render.render_children(DistBeliefJob.validated(load_example("digits-mlp.yaml")),
                                                                 image=context.DEFAULT_IMAGE)}
    service = children["Service"]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    worker = children["Deployment"]["spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    (container,) = worker["spec"]["containers"]
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= {p["name"] for p in container["ports"]}
    for monitor in (service_monitor, pod_monitor):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    assert service_monitor["metadata"]["labels"]["release"] == "prometheus"
    assert not of_kind(template(values_dir, "defaults"), "ServiceMonitor")
    defaults = template(values_dir, "defaults", "--set", "metrics.serviceMonitor.enabled=true")
    assert of_kind(defaults, "ServiceMonitor")[0]["spec"]["namespaceSelector"] == {"any": True}


def test_the_operators_metrics_port_service_and_monitor_come_only_when_enabled(values_dir: Path) -> None:
    """metrics.operator.enabled: the --metrics port on the container, a Service on it, the
    NetworkPolicy admitting it; the operator's ServiceMonitor only with serviceMonitor too."""
    defaults = template(values_dir, "defaults")
    assert [p["name"] for p in operator_container(defaults)["ports"]] == ["health"]
    assert not any(a.startswith("--metrics") for a in operator_container(defaults)["args"])
    assert not of_kind(defaults, "Service")
    alone = template(values_dir, "defaults", "--set", "metrics.operator.enabled=true")
    assert of_kind(alone, "Service") and not of_kind(alone, "ServiceMonitor")
    (policy,) = of_kind(alone, "NetworkPolicy")
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8081}]}]   # from anywhere

    docs = template(values_dir, "everything")
    deployment, container = operator_deployment(docs), operator_container(docs)
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    assert port["containerPort"] == 9200 and "--metrics=0.0.0.0:9200" in container["args"]
    (service,) = of_kind(docs, "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (service_port,) = service["spec"]["ports"]
    assert (service_port["name"], service_port["targetPort"]) == ("metrics", "metrics")
    (monitor,) = [m for m in of_kind(docs, "ServiceMonitor") if m["metadata"]["name"].endswith("-operator")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["honorLabels"] is True
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # The jobs' monitors select the jobs' objects only, never the operator's Service.
    for other in of_kind(docs, "ServiceMonitor"):
        if other is not monitor:
            assert not other["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (policy,) = of_kind(docs, "NetworkPolicy")
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9200}],
                                          "from": VALUES["everything"]["networkPolicy"]["metricsFrom"]}]


def test_the_dashboard_configmap_comes_only_when_enabled_with_the_sidecar_label(values_dir: Path) -> None:
    assert not of_kind(template(values_dir, "defaults"), "ConfigMap")
    (config_map,) = of_kind(template(values_dir, "everything"), "ConfigMap")
    meta = config_map["metadata"]
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["namespace"] == "monitoring" and meta["annotations"] == {"grafana_folder": "DistBelief"}
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads((CHART / "dashboards" / "distbelief.json").read_text())
    (in_release,) = of_kind(template(values_dir, "defaults", "--set", "metrics.dashboard.enabled=true"), "ConfigMap")
    assert in_release["metadata"]["namespace"] == NAMESPACE


# ------------------------------------------------------------------ RBAC


def test_rbac_for_every_watched_namespace(values_dir: Path) -> None:
    """A Role (and binding) per watched namespace, each with the same rules; cluster-wide
    only reading namespaces, CRDs and Kueue's ResourceFlavors (cluster-scoped)."""
    docs = template(values_dir, "namespaced")
    grants = operator_grants(docs)
    by_namespace = {ns: {(g.group, g.resource, g.verb, g.name) for g in grants if g.namespace == ns}
                    for ns in ("ml", "research")}
    assert by_namespace["ml"] == by_namespace["research"] and by_namespace["ml"]
    everywhere = {(g.group, g.resource, g.verb) for g in grants if g.namespace is None}
    assert everywhere == {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} | {
        ("", "namespaces", v) for v in ("list", "watch")} | {("kueue.x-k8s.io", "resourceflavors", "get")}
    # ... and the operator is told to watch exactly those namespaces.
    args = operator_container(docs)["args"]
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=ml", "--namespace=research"]


@pytest.mark.parametrize("mode", ["defaults", "namespaced"])
def test_the_operator_may_create_secrets_but_never_read_them(values_dir: Path, mode: str) -> None:
    grants = [g for g in operator_grants(template(values_dir, mode)) if g.resource == "secrets"]
    assert grants and {g.verb for g in grants} == {"create"}


def test_user_roles_aggregate_into_the_builtin_ones(values_dir: Path) -> None:
    docs = template(values_dir, "defaults")
    labels = {d["metadata"]["name"]: d["metadata"]["labels"] for d in of_kind(docs, "ClusterRole")}
    edit = next(n for n, lbl in labels.items() if lbl.get("rbac.authorization.k8s.io/aggregate-to-edit") == "true")
    view = next(n for n, lbl in labels.items() if lbl.get("rbac.authorization.k8s.io/aggregate-to-view") == "true")
    assert labels[edit]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true" and edit != view
    assert not [d for d in template(values_dir, "standalone") if d["kind"] == "ClusterRole"
                and "rbac.authorization.k8s.io/aggregate-to-view" in d["metadata"]["labels"]]


# ------------------------------------------------------------------ checkov

# Failed checkov checks we accept, with the reason (docs/install.md lists the same).
CHART_ACCEPTED = {
    "CKV_K8S_38": "the operator's pod mounts its ServiceAccount token: it is an API client (the ServiceAccount "
                  "itself turns automounting off for every other pod)",
    "CKV_K8S_43": "a digest exists only once the image is pushed: set image.digest (then the check passes)",
    "CKV_K8S_15": "IfNotPresent by default: with a digest no pull can change the image, and Always breaks "
                  "images loaded straight into a node (kind load); set image.pullPolicy=Always if you want it",
}
# On the children of the example jobs (operator/distbelief/operator/render.py).
CHILDREN_ACCEPTED = {
    "CKV_K8S_21": "the children live in the job's namespace; the examples name none, so `default`",
    "CKV_K8S_43": "the default runtime image is a tag; with a digest image (chart image.digest, or spec.image) "
                  "the check passes",
    "CKV_K8S_15": "the renderer leaves imagePullPolicy at the default (IfNotPresent for a tag)",
    "CKV_K8S_11": "CPU limits are the job's choice (spec.*.resources); the examples set memory limits only",
}


def checkov(folder: Path) -> dict[str, set[str]]:
    """check id -> the files and resources that failed it, for every manifest under folder."""
    assert CHECKOV is not None
    done = subprocess.run([CHECKOV, "--skip-download", "--framework", "kubernetes", "--directory", str(folder),
                           "--output", "json", "--quiet", "--compact"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode in (0, 1), done.stderr
    reports = json.loads(done.stdout)
    failed: dict[str, set[str]] = {}
    for report in reports if isinstance(reports, list) else [reports]:
        for check in (report.get("results") or {}).get("failed_checks", []):
            failed.setdefault(check["check_id"], set()).add(f"{check['file_path']}: {check['resource']}")
    return failed


needs_checkov = pytest.mark.skipif(CHECKOV is None, reason="checkov not found: tools/fetch-checkov installs it")


@needs_checkov
def test_checkov_on_the_rendered_chart(values_dir: Path, tmp_path: Path) -> None:
    for name in VALUES:
        (tmp_path / name).mkdir()
        for index, doc in enumerate(template(values_dir, name)):
            (tmp_path / name / f"{index:02d}-{doc['kind']}.yaml").write_text(yaml.safe_dump(doc))
    failed = checkov(tmp_path)
    unexpected = {check: sorted(r) for check, r in failed.items() if check not in CHART_ACCEPTED}
    assert not unexpected, f"checkov fails the chart on {unexpected}"
    # With a digest (the `everything` values), the digest check passes.
    assert not [r for r in failed.get("CKV_K8S_43", set()) if "/everything/" in r], failed


def _render_examples(folder: Path, *extra: str) -> None:
    folder.mkdir()
    for example in sorted((REPO / "examples").glob("*.yaml")):
        out = run_cli("render", str(example), *extra, timeout=60, check=True).stdout
        (folder / example.name).write_text(out)


@needs_checkov
def test_checkov_on_a_jobs_rendered_children(tmp_path: Path) -> None:
    _render_examples(tmp_path / "tag")
    failed = checkov(tmp_path / "tag")
    unexpected = {check: sorted(r) for check, r in failed.items() if check not in CHILDREN_ACCEPTED}
    assert not unexpected, f"checkov fails the rendered children on {unexpected}"
    _render_examples(tmp_path / "digest", "--image", f"registry.example/distbelief@{DIGEST}")
    assert "CKV_K8S_43" not in checkov(tmp_path / "digest")


def test_accepted_checks_are_listed_with_their_reasons_in_the_docs() -> None:
    text = DOCS.read_text()
    missing = sorted(c for c in {*CHART_ACCEPTED, *CHILDREN_ACCEPTED} if c not in text)
    assert not missing, f"docs/install.md does not list the accepted checkov checks {missing}"
