"""Locating and reading the files under deploy/, and the PromQL inside them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
RULE_FILES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "hipfire-serve.json"

# Values the dashboard's template variables take when its queries run outside Grafana.
GRAFANA_VARS = {"$__rate_interval": "1m", "$model_name": ".*", "$tenant": ".*"}

_METRIC_RE = re.compile(r"\bhipfire:[a-z0-9_]+")
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_panels() -> list[dict]:
    return [p for p in load_dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana variables filled in) for every panel target."""
    out = []
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((panel["title"], expr))
    return out


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for g in load_yaml(path)["groups"] for rule in g["rules"]]


def rule_exprs() -> list[tuple[str, str]]:
    return [(r.get("record") or r["alert"], r["expr"]) for r in rules()]


def variable_queries() -> list[str]:
    """The label_values(...) series selectors of the dashboard's query variables."""
    out = []
    for var in load_dashboard()["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["definition"])
            assert m, var["definition"]
            out.append(m.group(1).replace("$model_name", ".*"))
    return out


def referenced_metrics(text: str) -> set[str]:
    """hipfire: metric family names used in PromQL text (histogram/counter suffixes removed)."""
    names = set()
    for name in _METRIC_RE.findall(text):
        for suffix in (*_HIST_SUFFIXES, "_total"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def all_referenced_metrics() -> set[str]:
    texts = [e for _, e in dashboard_exprs()] + [e for _, e in rule_exprs()]
    texts += variable_queries()
    texts.append((DEPLOY / "k8s" / "prometheus-adapter-rules.yaml").read_text())
    return set().union(*(referenced_metrics(t) for t in texts))


def exported_families(exposition: str) -> set[str]:
    """Metric family names declared by `# TYPE` lines of a /metrics page, with the `_total`
    suffix of counters removed (as prometheus_client declares them)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            names.add(name[: -len("_total")] if name.endswith("_total") else name)
    return names
