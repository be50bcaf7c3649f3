"""Write the chart's Grafana dashboards (helm/openforge/dashboards/*.json).

The dashboards are generated so that every panel has the same shape (datasource variable, namespace
filter, units) and so a new panel is one line here. Run it after editing and commit the JSON; a test
checks that the committed files equal what this script writes, and another that every metric the
panels query is an instrument the code defines.

Metric names are the Prometheus forms of the OpenTelemetry instruments, as the collector's Prometheus
exporter writes them: dots become underscores, the unit is appended (seconds), counters end in _total,
histograms are read through _bucket/_sum/_count.

Usage: python scripts/helm/make_dashboards.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "helm" / "openforge" / "dashboards"
NS = 'k8s_namespace_name=~"$namespace"'
RATE = "$__rate_interval"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr,
            "legendFormat": legend, "refId": ref}


def panel(title: str, description: str, targets: list[tuple[str, str]], unit: str = "short",
          kind: str = "timeseries") -> dict[str, Any]:
    """One panel; targets are (PromQL, legend) pairs."""
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}},
        "targets": [{**_target(expr, legend, chr(ord("A") + i)), **({"format": "heatmap"} if kind == "heatmap" else {})}
                    for i, (expr, legend) in enumerate(targets)],
    }


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram (metric without the _bucket suffix)."""
    group = f"le{', ' + by if by else ''}"
    label = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{NS}}}[{RATE}])))", f"p{int(q * 100)}{label}")
            for q in (0.5, 0.9, 0.99)]


def dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]]) -> dict[str, Any]:
    """A dashboard with a datasource and a namespace variable; panels two to a row."""
    for i, p in enumerate(panels):
        p["id"] = i + 1
        p["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)}
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["openforge"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "namespace", "label": "Namespace", "type": "query",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(openforge_proxy_calls_total, k8s_namespace_name)", "refId": "ns"},
             "definition": "label_values(openforge_proxy_calls_total, k8s_namespace_name)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "current": {}, "hide": 0},
            # The flight recorder (openforge ui) opens a rollout, or the rollout of a trace, from these.
            {"name": "ui_url", "label": "Flight recorder", "type": "textbox", "query": "http://127.0.0.1:8200",
             "current": {"text": "http://127.0.0.1:8200", "value": "http://127.0.0.1:8200"}, "hide": 0},
            {"name": "rollout_id", "label": "Rollout", "type": "textbox", "query": "", "current": {}, "hide": 0},
            {"name": "trace_id", "label": "Trace id", "type": "textbox", "query": "", "current": {}, "hide": 0},
        ]},
        "links": [
            {"title": "Flight recorder", "type": "link", "url": "${ui_url}/", "targetBlank": True, "icon": "dashboard"},
            {"title": "Rollout in the flight recorder", "type": "link", "url": "${ui_url}/rollouts/${rollout_id}",
             "targetBlank": True, "icon": "external link"},
            {"title": "Trace in the flight recorder", "type": "link", "url": "${ui_url}/traces/${trace_id}",
             "targetBlank": True, "icon": "external link"},
        ],
        "panels": panels,
    }


def proxy() -> dict[str, Any]:
    return dashboard("openforge-proxy", "OpenForge / Proxy",
                     "Model calls through the capture proxy: throughput, latency, and the spool that keeps calls "
                     "when Kafka is away.", [
        panel("Calls/s", "Model calls handled, by protocol and status.",
              [(f"sum by (protocol, status) (rate(openforge_proxy_calls_total{{{NS}}}[{RATE}]))", "{{protocol}} {{status}}")],
              "reqps"),
        panel("Tokens/s", "Prompt and completion tokens of captured calls.",
              [(f"sum by (kind) (rate(openforge_proxy_tokens_total{{{NS}}}[{RATE}]))", "{{kind}}")]),
        panel("Time to first token", "From request to the first sampled token.",
              quantiles("openforge_proxy_time_to_first_token_seconds"), "s"),
        panel("Proxy added latency", "Time spent in the proxy outside the engine call.",
              quantiles("openforge_proxy_added_latency_seconds"), "s"),
        panel("Refused requests/s", "Requests answered with an error before any engine work, by HTTP status: "
              "credentials (401, 403), bodies over the limit (413), a full journal or disk (503), a malformed reward "
              "(400). A rise in 401 is usually a signing-key mismatch between launcher and proxy.",
              [(f"sum by (status) (rate(openforge_proxy_refused_total{{{NS}}}[{RATE}]))", "{{status}}")], "reqps"),
        panel("Spool depth", "Call events waiting on local disk for Kafka (0 when Kafka keeps up).",
              [(f"sum by (k8s_pod_name) (openforge_proxy_spool_depth{{{NS}}})", "{{k8s_pod_name}}")]),
        panel("Failed hand-offs to Kafka, failed journal flushes/s",
              "Journal batches Kafka did not take and that are sent again. Nothing is lost; the spool depth "
              "shows what waits. "
              "A failed flush of the journal to its disk is a disk to look at: records written before it "
              "are safe only once Kafka has them.",
              [(f"sum(rate(openforge_proxy_publish_errors_total{{{NS}}}[{RATE}]))", "failed"),
               (f"sum(rate(openforge_proxy_journal_flush_errors_total{{{NS}}}[{RATE}]))", "journal flush failed")]),
    ])


def pipeline() -> dict[str, Any]:
    return dashboard("openforge-pipeline", "OpenForge / Pipeline",
                     "From rollouts to trajectories: consumer lag, assembly, rewards, rollout outcomes and "
                     "checkpoint publishing.", [
        panel("Consumer lag per group", "Records not yet handled, per consumer group and topic.",
              [(f"sum by (group, topic) (openforge_consumer_lag{{{NS}}})", "{{group}} {{topic}}")]),
        panel("Trajectories/s", "Trajectories the assembler wrote (transactionally).",
              [(f"sum(rate(openforge_assembler_trajectories_total{{{NS}}}[{RATE}]))", "trajectories")]),
        panel("Reward by task", "Mean verifier reward per task over the window.",
              [(f"sum by (task) (rate(openforge_assembler_reward_sum{{{NS}}}[{RATE}])) / "
                f"sum by (task) (rate(openforge_assembler_reward_count{{{NS}}}[{RATE}]))", "{{task}}")]),
        panel("Rollout outcomes by reason", "Finished rollouts by outcome (completed, failed, timed out) and reason.",
              [(f"sum by (outcome, reason) (rate(openforge_rollout_outcomes_total{{{NS}}}[{RATE}]))",
                "{{outcome}} {{reason}}")]),
        panel("Rollout failures by reason", "Trajectories without a scored result, by failure reason (see the "
              "failure taxonomy in docs/rollouts.md). Infrastructure failures (infrastructure=true) are left out "
              "of group statistics; the rest count against the policy.",
              [(f"sum by (reason, infrastructure) (rate(openforge_assembler_failures_total{{{NS}}}[{RATE}]))",
                "{{reason}} (infrastructure={{infrastructure}})")]),
        panel("Checkpoint publish latency", "Time to load one checkpoint into one vLLM replica (pause, reload, "
              "relabel, resume).", quantiles("openforge_publisher_publish_latency_seconds"), "s"),
        panel("Checkpoint loads", "Checkpoint loads attempted on vLLM replicas, by outcome, and loads that failed "
              "verification (the replica's parameter digests differed from the checkpoint's), by what followed.",
              [(f"sum by (outcome) (rate(openforge_publisher_applied_total{{{NS}}}[{RATE}]))", "{{outcome}}"),
               (f"sum by (outcome) (rate(openforge_publisher_verify_failures_total{{{NS}}}[{RATE}]))",
                "not verified: {{outcome}}")]),
        panel("Weights sent", "Bytes of weights sent to replicas over NCCL (hashed instead, in dry mode), by "
              "backend; the disk backend sends none (replicas read the folder).",
              [(f"sum by (backend) (rate(openforge_publisher_transferred_bytes_total{{{NS}}}[{RATE}]))",
                "{{backend}}")], "Bps"),
        panel("Weight update timeouts", "Update steps that hit their limit (an HTTP call to a replica, an NCCL "
              "rendezvous or broadcast), by step: each is an error event, never a silent hang.",
              [(f"sum by (step) (rate(openforge_publisher_timeouts_total{{{NS}}}[{RATE}]))", "{{step}}")]),
        panel("Staleness distribution", "Published weight versions between a trajectory's oldest token and the "
              "learner's newest version.",
              [(f"sum by (le) (rate(openforge_learner_staleness_bucket{{{NS}}}[{RATE}]))", "{{le}}")],
              kind="heatmap"),
        panel("Open rollouts", "Rollouts the assembler has joined but not yet finalized.",
              [(f"sum(openforge_assembler_open_rollouts{{{NS}}})", "open")]),
        panel("Sample merge break rate", "Share of calls whose prompt did not extend the previous context "
              "(a new sample started), by harness.",
              [(f"sum by (harness) (rate(openforge_assembler_merge_breaks_total{{{NS}}}[{RATE}])) / "
                f"sum by (harness) (rate(openforge_assembler_merge_calls_total{{{NS}}}[{RATE}]))", "{{harness}}")],
              "percentunit"),
        panel("Merge breaks by drift reason", "Calls that started a new sample, by harness and by why the prompt "
              "did not extend the earlier context (docs/assembler.md).",
              [(f"sum by (harness, reason) (rate(openforge_assembler_merge_breaks_total{{{NS}}}[{RATE}]))",
                "{{harness}} {{reason}}")]),
        panel("Tool errors and recovery", "Share of tool results that were errors, and share of those errors "
              "after which a later call of the same tool succeeded, by harness.", [
                  (f"sum by (harness) (rate(openforge_assembler_tool_errors_total{{{NS}}}[{RATE}])) / "
                   f"sum by (harness) (rate(openforge_assembler_tool_results_total{{{NS}}}[{RATE}]))",
                   "errors {{harness}}"),
                  (f"sum by (harness) (rate(openforge_assembler_tool_errors_total{{recovered=\"true\", {NS}}}"
                   f"[{RATE}])) / sum by (harness) (rate(openforge_assembler_tool_errors_total{{{NS}}}[{RATE}]))",
                   "recovered {{harness}}")], "percentunit"),
        panel("Assembler anomalies", "Events the assembler dropped or set aside: duplicates, late and replayed "
              "events, dead letters, oversized trajectories.", [
                  (f"sum(rate(openforge_assembler_duplicates_total{{{NS}}}[{RATE}]))", "duplicates"),
                  (f"sum(rate(openforge_assembler_late_events_total{{{NS}}}[{RATE}]))", "late"),
                  (f"sum(rate(openforge_assembler_replayed_events_total{{{NS}}}[{RATE}]))", "replayed"),
                  (f"sum by (error_type) (rate(openforge_assembler_dead_letters_total{{{NS}}}[{RATE}]))",
                   "dead letters {{error_type}}"),
                  (f"sum(rate(openforge_assembler_oversized_total{{{NS}}}[{RATE}]))", "oversized")]),
    ])


def learner() -> dict[str, Any]:
    return dashboard("openforge-learner", "OpenForge / Learner",
                     "The off-policy learner: loss, entropy, and how much importance sampling corrects.", [
        panel("Loss", "Policy loss of the last step.", [(f"avg(openforge_learner_loss{{{NS}}})", "loss")]),
        panel("Entropy", "Mean token entropy of the policy on the last batch.",
              [(f"avg(openforge_learner_entropy{{{NS}}})", "entropy")]),
        panel("Importance weights", "Quantiles, mean and maximum of the per-token importance weights (behavior "
              "vs current policy).", [*quantiles("openforge_learner_importance_weight"),
                                      (f"sum(rate(openforge_learner_importance_weight_sum{{{NS}}}[{RATE}])) / "
                                       f"sum(rate(openforge_learner_importance_weight_count{{{NS}}}[{RATE}]))",
                                       "mean"),
                                      (f"max(openforge_learner_importance_weight_max{{{NS}}})", "max")]),
        panel("Effective sample size", "Effective sample size of the importance weights, as a fraction of the batch.",
              [(f"avg(openforge_learner_effective_sample_size{{{NS}}})", "ESS")], "percentunit"),
        panel("Staleness", "Quantiles of the age of each trajectory's oldest token, in published versions.",
              quantiles("openforge_learner_staleness")),
        panel("Stale tokens masked/s", "Sampled tokens older than the staleness bound, masked out of the loss of "
              "trajectories that still trained. Whole trajectories with nothing fresh left are counted as "
              "dropped (stale) in the panel beside.",
              [(f"sum(rate(openforge_learner_stale_tokens_total{{{NS}}}[{RATE}]))", "masked tokens")]),
        panel("Steps/s", "Optimizer steps.", [(f"sum(rate(openforge_learner_steps_total{{{NS}}}[{RATE}]))", "steps")]),
        panel("Step duration", "Wall time of one optimizer step.", quantiles("openforge_learner_step_duration_seconds"),
              "s"),
        panel("Trained tokens/s", "Tokens the learner trained on (loss-masked completion tokens).",
              [(f"sum(rate(openforge_learner_tokens_total{{{NS}}}[{RATE}]))", "tokens")]),
        panel("Trajectories trained and dropped", "Trajectories trained, and those not trained by reason.", [
            (f"sum(rate(openforge_learner_trajectories_total{{{NS}}}[{RATE}]))", "trained"),
            (f"sum by (reason) (rate(openforge_learner_dropped_total{{{NS}}}[{RATE}]))", "dropped {{reason}}")]),
        panel("Short groups and skipped steps", "Groups released at their deadline with members missing (trained "
              "with the members they had, or dropped when fewer than the minimum were usable), and steps skipped "
              "because the loss or gradient was not finite.", [
            (f"sum by (outcome) (rate(openforge_learner_short_groups_total{{{NS}}}[{RATE}]))", "short, {{outcome}}"),
            (f"sum(rate(openforge_learner_skipped_steps_total{{{NS}}}[{RATE}]))", "skipped steps")]),
        panel("Batch reward", "Mean reward of the trajectories in the last step.",
              [(f"avg(openforge_learner_reward_mean{{{NS}}})", "reward")]),
        panel("Weight version", "The newest version the learner has published (one per checkpoint).",
              [(f"max(openforge_learner_version{{{NS}}})", "version")]),
    ])


DASHBOARDS = {"proxy": proxy, "pipeline": pipeline, "learner": learner}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"openforge-{name}.json": json.dumps(make(), indent=2) + "\n" for name, make in DASHBOARDS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed files differ")
    args = parser.parse_args()
    stale = []
    for filename, text in render().items():
        path = OUT / filename
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(filename)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (rerun scripts/helm/make_dashboards.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
