"""The chart's Grafana dashboard (charts/distbelief/dashboards/distbelief.json) against a real
Prometheus scraping a real local-mode job: every PromQL expression of every panel, with the
dashboard's variables filled in as Grafana would, returns series.

A value must be a number, not NaN: a latency panel whose histogram saw nothing shows
nothing in Grafana either. Prometheus finds the job's pods in the run's metrics-targets.json (file_sd_configs), with
the labels the chart's monitors give a cluster's pods (namespace, pod, distbelief_io_job,
distbelief_io_role), scraping every second. Without a `prometheus` binary the test skips
locally and fails under CI=true (`make kube-tools` installs one: tools/fetch-prometheus).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from distbelief.operator.local import local
from support.cluster import stop_process, unavailable
from support.examples import load_example
from support.paths import REPO
from support.ports import free_port
from support.waiting import eventually

pytestmark = pytest.mark.slow

DASHBOARD = REPO / "charts" / "distbelief" / "dashboards" / "distbelief.json"
# What Grafana puts for $__rate_interval: at least four scrape intervals (1 s here).
RATE_INTERVAL = "10s"
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)|\[\[(\w+)\]\]")   # Grafana's three spellings
LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?(\w+)\)$")


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            answer = json.load(response)
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The series of an instant query (/api/v1/query)."""
        return self.get("/api/v1/query", query=expr)["result"]

    def label_values(self, label: str, selector: str | None) -> list[str]:
        return self.get(f"/api/v1/label/{label}/values", **({"match[]": selector} if selector else {}))


@pytest.fixture
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        unavailable("no prometheus on PATH: tools/fetch-prometheus installs it (as root, with apt-get)")
    assert found is not None
    return found


@pytest.fixture
def training(tmp_path: Path) -> Iterator[Path]:
    """The digits example trained by `distbelief run` for as long as the test needs: its output
    folder. Its replicas pull on their own as well as push (fetchEvery 3, pushEvery 2), so the
    pull latency has samples."""
    doc = load_example("digits-mlp.yaml")
    doc["spec"]["training"].update(maxSteps=10_000_000, fetchEvery=3, pushEvery=2)
    doc["spec"]["workers"]["replicas"] = 2
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    output = tmp_path / "out"
    with open(tmp_path / "run.log", "wb") as log:   # what the run says, beside its pods' logs in out/logs
        run = subprocess.Popen([sys.executable, "-m", "distbelief.operator.cli", "run", str(job), "--output",
                                str(output), "--no-progress"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield output
    finally:
        stop_process(run, signal.SIGINT, timeout=60)


@pytest.fixture
def prometheus(tmp_path: Path, prometheus_binary: str, training: Path) -> Iterator[Prometheus]:
    targets = training / local.TARGETS_FILE
    eventually(targets.exists, 60, interval=0.2, what=f"{targets} written by the run")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "distbelief",
                            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}]}))
    port = free_port()
    with open(tmp_path / "prometheus.log", "wb") as log:
        server = subprocess.Popen([prometheus_binary, f"--config.file={config}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        stop_process(server)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def substitute(text: str, values: dict[str, str]) -> str:
    """text with every Grafana variable replaced; an unknown variable fails, naming it."""
    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        assert name in values, f"the dashboard uses ${name}, which it does not define: {text}"
        return values[name]

    return VARIABLE.sub(value, text)


def pick_variables(dashboard: dict[str, Any], prometheus: Prometheus) -> dict[str, str]:
    """Each query variable's first value, in order, as Grafana offers them (label_values
    over the variables before it); every variable must offer one."""
    values = {"__rate_interval": RATE_INTERVAL}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = LABEL_VALUES.match(substitute(variable["query"]["query"], values))
        assert match, f"variable {variable['name']}: not a label_values(...) query: {variable['query']}"
        offered = prometheus.label_values(match[2], match[1])
        assert offered, f"variable {variable['name']} offers nothing: {match[0]}"
        values[variable["name"]] = offered[0]
    return values


def panels_without_data(dashboard: dict[str, Any], prometheus: Prometheus, values: dict[str, str]) -> list[str]:
    """Every panel expression that returns no series, or none with a number, as 'panel (refId): expr'."""
    def has_data(expr: str) -> bool:
        return any(not math.isnan(float(series["value"][1])) for series in prometheus.query(expr))

    return [f"{panel['title']} ({target['refId']}): {target['expr']}"
            for panel in dashboard["panels"] for target in panel.get("targets", [])
            if not has_data(substitute(target["expr"], values))]


def test_every_panel_of_the_dashboard_returns_series_for_a_running_job(prometheus: Prometheus,
                                                                      training: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expected = len(json.loads((training / local.TARGETS_FILE).read_text()))
    eventually(lambda: _ready(prometheus.url), 30, interval=0.2, what="Prometheus ready")
    # Every pod scraped for a rate window, and the chief's first evaluation in.
    eventually(lambda: len(prometheus.query(f'count_over_time(up{{job="distbelief"}}[{RATE_INTERVAL}]) >= 5 '
                                            'and up == 1')) == expected, 60, interval=0.5,
               what=f"all {expected} pods scraped for {RATE_INTERVAL}")
    eventually(lambda: prometheus.query("distbelief_evaluated_step > 0"), 60, interval=0.5,
               what="the chief's first evaluation scraped")

    values = pick_variables(dashboard, prometheus)
    assert (values["namespace"], values["job"]) == ("default", "digits")
    empty = panels_without_data(dashboard, prometheus, values)
    assert not empty, "panels whose queries return no data:\n  " + "\n  ".join(empty)
    step_rate = dashboard["panels"][0]
    assert step_rate["title"] == "Global step rate"
    rates = prometheus.query(substitute(step_rate["targets"][0]["expr"], values))
    assert len(rates) == 2 and all(float(series["value"][1]) > 0 for series in rates), rates

    # The check catches a panel whose metric nobody exports (here a misspelt name).
    broken = copy.deepcopy(dashboard)
    target = broken["panels"][2]["targets"][0]
    target["expr"] = target["expr"].replace("distbelief_heldout_accuracy", "distbelief_heldout_acuracy")
    assert panels_without_data(broken, prometheus, values) == [f"Held-out accuracy (A): {target['expr']}"]
