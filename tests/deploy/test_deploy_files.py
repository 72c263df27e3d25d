"""Static checks of deploy/: Prometheus config and rules (promtool), the Grafana dashboard,
compose, Kubernetes manifests, Dockerfiles and the systemd unit."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess

import pytest
import yaml

from hipfire_serve.server.config import resolve
from hipfire_serve.server.metrics import ServerMetrics
from tests.deploy.deploy_files import (
    DEPLOY,
    PROMETHEUS_YML,
    REPO,
    RULE_FILES,
    all_referenced_metrics,
    dashboard_panels,
    exported_families,
    load_dashboard,
    load_yaml,
    rules,
)


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is missing in CI (scripts/_services.sh installs it)")
        pytest.skip(f"{tool} not installed")
    return path


def test_promtool_accepts_config_and_rules():
    promtool = need("promtool")
    subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], check=True,
                   capture_output=True)  # fmt: skip
    subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], check=True,
                   capture_output=True)  # fmt: skip


def test_rules_cover_the_required_figures_and_alerts():
    records = {r["record"] for r in rules() if "record" in r}
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert {
        "model_name:hipfire_generation_tokens:rate1m",
        "model_name:hipfire_spec_acceptance_rate:ratio_rate5m",
        "model_name:hipfire_time_to_first_token_seconds:p99_rate5m",
        "model_name:hipfire_inter_token_latency_seconds:p99_rate5m",
        "model_name:hipfire_spec_share:ratio_rate5m",
    } <= records
    assert all(re.fullmatch(r"[a-z_]+:[a-z_0-9]+:[a-z_0-9]+", r) for r in records)
    assert set(alerts) == {
        "HipfireServerDown", "HipfireQueueGrowing", "HipfireKVCacheNearFull",
        "HipfireTTFTOverSLO", "HipfireAcceptanceCollapse",
    }  # fmt: skip
    for alert in alerts.values():
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["annotations"]["summary"]


def test_every_metric_used_is_exported_by_the_server():
    """Dashboard, rules and the autoscaler adapter name only metrics the server declares."""
    exported = exported_families(ServerMetrics("m").render().decode())
    used = all_referenced_metrics()
    assert used, "no hipfire: metrics found in deploy/"
    assert used - exported == set()


def test_dashboard_structure():
    dash = load_dashboard()
    panels = dashboard_panels()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in panels}
    assert {
        "Throughput (tokens/s)", "TTFT p50 / p99", "ITL p50 / p99", "Live slots vs capacity",
        "Backlog", "Spec requests and rows per round", "Acceptance",
        "Predicted vs measured round time", "Tokens/s per tenant", "TTFT p99 per tenant",
    } <= titles  # fmt: skip
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used)
            assert target["datasource"]["uid"] == "${datasource}"
    # No two panels overlap on the 24-column grid.
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        box = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & box, p["title"]
        cells |= box


def test_grafana_provisioning_points_at_the_dashboards():
    compose = load_yaml(DEPLOY / "compose.yaml")
    mounts = compose["services"]["grafana"]["volumes"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in mounts
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/hipfire-serve.yml")
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_compose_wires_server_prometheus_grafana():
    compose = load_yaml(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"hipfire-serve", "prometheus", "grafana"}
    server = services["hipfire-serve"]
    assert (DEPLOY / server["build"]["context"] / server["build"]["dockerfile"]).is_file()
    gpu = server["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    targets = load_yaml(PROMETHEUS_YML)["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["hipfire-serve:8000"]  # the compose service name and port

    class ComposeLoader(yaml.SafeLoader):
        pass

    ComposeLoader.add_constructor("!reset", lambda loader, node: None)
    rocm = yaml.load((DEPLOY / "compose.rocm.yaml").read_text(), Loader=ComposeLoader)
    build = rocm["services"]["hipfire-serve"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    assert "/dev/kfd" in rocm["services"]["hipfire-serve"]["devices"]


def test_kubernetes_manifests():
    k8s = DEPLOY / "k8s"
    docs = {}
    for path in sorted(k8s.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    assert set(docs) == {"Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler",
                         "ConfigMap", "Kustomization"}  # fmt: skip
    listed = set(docs["Kustomization"]["resources"])
    assert listed == {p.name for p in k8s.glob("*.yaml")} - {"kustomization.yaml"}
    pod = docs["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"][0]["name"] == "http"
    labels = pod["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"] == labels
    assert docs["Service"]["spec"]["ports"][0]["name"] == "http"
    endpoint = docs["ServiceMonitor"]["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    adapter = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"][0]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == adapter["name"]["as"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 30  # outlasts the drain timeout


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.rocm"])
def test_dockerfiles(name):
    text = (DEPLOY / name).read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[0].startswith("ARG BASE_IMAGE=")
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().split()
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (REPO / src).exists(), src
        assert f"!{src}" in ignore or f"!{src}/" in ignore, src  # not excluded from the context
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    assert "EXPOSE 8000" in text and "/health" in text
    assert 'ENTRYPOINT ["hipfire-serve", "serve"]' in text
    if name.endswith("rocm"):
        assert "gfx1151" in text and "gfx1201" in text and "torch.version.hip" in text


def test_systemd_unit(tmp_path):
    unit_path = DEPLOY / "systemd" / "hipfire-serve.service"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string(unit_path.read_text())
    service = unit["Service"]
    assert service["ExecStart"].split()[1:] == ["serve", "--config",
                                                "/etc/hipfire-serve/config.toml"]  # fmt: skip
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 30
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # The example settings file is one the server accepts.
    engine, server = resolve(["--config", str(DEPLOY / "systemd" / "config.toml")], environ={})
    assert (server.host, server.port, engine.spec_mode) == ("0.0.0.0", 8000, "adaptive")
    analyze = shutil.which("systemd-analyze")
    if analyze:
        # verify insists that ExecStart exists: check a copy pointing at a present binary.
        copy = tmp_path / "hipfire-serve.service"
        copy.write_text(unit_path.read_text().replace(service["ExecStart"].split()[0], "/bin/true"))
        done = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True)
        assert done.returncode == 0 and "hipfire-serve.service" not in done.stderr, done.stderr
