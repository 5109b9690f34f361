#!/usr/bin/env python3
"""Writes deploy/grafana/README.md from aloe-dashboard.json: every panel with its description
and the PromQL of each of its queries, so the document cannot drift from the dashboard
(tests/integration/prometheus_test.cc checks that every panel query appears in the README).

Usage: deploy/grafana/make-readme.py [--check]
  --check  exit 1 (and write nothing) when README.md is not what this script would write
"""
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent

HEADER = """# Grafana dashboard

`aloe-dashboard.json` (uid `aloe-training`) shows one ALOE training job from the Prometheus
server configured in `../prometheus/` (jobs `aloe-server`, `aloe-shard`, `aloe-trainer`,
`aloe-evaluator`; names of the form `level:metric:operation` are recording rules from
`../prometheus/rules/aloe.rules.yml`). Import it in Grafana (Dashboards -> New -> Import ->
upload the JSON) and pick the Prometheus data source; it needs Grafana 9 or newer.

With a layer-sharded server, `aloe-server` is the coordinator and the row "Shard processes"
shows each shard (job `aloe-shard`); with one process that row is empty. The "Server payload"
and "Push and apply latency" panels read every server process of both jobs (rule group
`aloe-server-processes`), so they show the whole server in either layout.

`tests/integration/prometheus_test.cc` runs Debian's real Prometheus with the shipped
configuration against a live server, two trainers and an evaluator, and against a
layer-sharded server (coordinator, two shard processes, a trainer) for the "Shard processes"
row and the panels that read both layouts, and fails if any query below, or any recording
rule, returns no data.

This file is generated: edit the dashboard, then run `deploy/grafana/make-readme.py`.

## Panels
"""


def render(dashboard):
    out = [HEADER]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.append(f"\n### {panel['title']}\n")
            continue
        out.append(f"\n**{panel['title']}** ({panel['type']}). {panel.get('description', '')}\n")
        for target in panel.get("targets", []):
            legend = target.get("legendFormat", "")
            out.append(f"- `{target['expr']}`" + (f" (legend `{legend}`)" if legend else "") + "\n")
    return "".join(out)


def main():
    check = "--check" in sys.argv[1:]
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__.strip())
        return 0
    dashboard = json.loads((HERE / "aloe-dashboard.json").read_text())
    text = render(dashboard)
    readme = HERE / "README.md"
    if check:
        if not readme.exists() or readme.read_text() != text:
            print("deploy/grafana/README.md is out of date: run deploy/grafana/make-readme.py")
            return 1
        return 0
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
