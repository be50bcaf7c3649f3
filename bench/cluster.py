"""Rollouts at scale on the simulated cluster: launch rate, watcher lag, API-server requests.

Run from the repository root with ``python -m bench.cluster`` (``make kube`` builds the cluster's
programs). It starts the simulated cluster of ``tests/simcluster.py`` (real etcd, API server,
scheduler and controller manager; kwok playing ``--nodes`` nodes) and runs the scale-and-fault
scenario of ``tests/cluster_scenario.py`` with the shipped launcher and pod watcher: ``--rollouts``
rollouts in groups of 4 under an in-flight cap of ``--max-in-flight``, with image pull errors, OOM
kills, evictions and a node going NotReady, while the launcher is restarted once, the watcher twice
and the API server once. It prints (and with ``--json`` saves):

* **launch pods/s**: the launcher's ``scheduled`` events per second, first to last;
* **watcher lag** p50/p99: from the pod's transition (the time kwok writes into its status) to the
  lifecycle event's Kafka timestamp, for ``running`` and for terminal phases;
* **API-server requests**: ``apiserver_request_total`` over the run, by verb, and for pods.

Everything shares the machine's cores with the cluster; read the figures as lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.broker import private_broker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from cluster_scenario import infra_marking_errors, run_scenario
from kubeapi import kube_bin_dir
from simcluster import SimCluster

from stream import KafkaSettings


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        broker = private_broker(tmp / "kafka")
        broker.start()
        bootstrap = broker.bootstrap
    cluster = SimCluster(tmp / "cluster", kube_bin_dir(), nodes=args.nodes, pace=args.pace)
    try:
        await asyncio.to_thread(cluster.start)
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:8]}.",
                              partitions=4)
        result = await run_scenario(cluster, kafka, rollouts=args.rollouts, group_size=4,
                                    max_in_flight=args.max_in_flight, finished_ttl_s=args.ttl,
                                    timeout_s=args.timeout, progress=lambda text: print(text, flush=True))
    finally:
        await asyncio.to_thread(cluster.stop)
        if broker is not None:
            broker.stop()
    summary = result.summary()
    terminal = result.terminal()
    summary["checks"] = {
        "every rollout one terminal event": len(terminal) == len(result.rollouts),
        "infrastructure marking per taxonomy": not infra_marking_errors(result),
        "restarts launcher/watcher/apiserver": [result.launcher_restarts, result.watcher_restarts,
                                                result.apiserver_restarts],
        "pods and secrets left after TTL": [result.pods_left, result.secrets_left],
    }
    return summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--max-in-flight", type=int, default=500)
    parser.add_argument("--pace", type=float, default=1.0, help="scales every simulated pod duration")
    parser.add_argument("--ttl", type=float, default=10.0, help="the watcher's finished-pod TTL, seconds")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--bootstrap", default=None, help="an existing Kafka (host:port); else a private broker")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        summary = asyncio.run(run(args, Path(tmp)))
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
