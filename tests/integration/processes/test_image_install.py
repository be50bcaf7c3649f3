"""What the container image holds, installed and run away from the source tree.

The Dockerfile installs OpenForge with ``scripts/image/install.sh``; this runs the same script
into a new virtual environment (the learner's 5 GiB stack left out: ``make learner`` installs it
with its own script, which the image's install calls unchanged) and starts the installed
``openforge proxy`` from another folder, in front of the real vLLM and the real broker. A module
the package leaves out, a file read from the source tree, or a build tool the image does not have
(the install runs with no Rust toolchain on its path) fails here instead of in a cluster. Building the image itself needs a
container engine these machines do not have; the checks of the Dockerfile against the chart are
at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from netutil import free_port
from proxy_helpers import KEY, read_events

from schemas import ModelCallV1
from schemas.credentials import Role, mint_token
from stream import CALLS, KafkaSettings, TopicRegistry

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("image") / "openforge"
    # Nothing compiled ships: the install must not need Rust's cargo, which users of a Python
    # stack rarely have, so it runs with no folder holding one on its path.
    path = [folder for folder in os.environ["PATH"].split(os.pathsep)
            if folder and not (Path(folder) / "cargo").exists()]
    env = {**os.environ, "OPENFORGE_IMAGE_LEARNER": "0", "OPENFORGE_IMAGE_PYTHON": sys.executable,
           "PATH": os.pathsep.join(path)}
    before = _build_leftovers()
    done = subprocess.run(["bash", str(REPO / "scripts/image/install.sh"), str(venv)], env=env, cwd=venv.parent,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    written = sorted(set(_build_leftovers().items()) - set(before.items()))
    assert not written, f"the install wrote into the source tree: {written[:5]}"
    return venv


def _build_leftovers() -> dict[str, int]:
    """Each file under the source tree's build/ and egg-info, with its modification time.

    A build there is copied over, not replaced: a module deleted since would ship again. Times
    rather than presence, so an earlier build left in a checkout does not hide a new one.
    """
    found: dict[str, int] = {}
    for top in [REPO / "build", *REPO.glob("*.egg-info")]:
        for path in [top, *top.rglob("*")] if top.exists() else []:
            found[str(path.relative_to(REPO))] = path.stat().st_mtime_ns
    return found


async def test_the_installed_proxy_serves_and_ships_from_outside_the_source_tree(
        image_venv: Path, vllm_url: str, kafka_settings: KafkaSettings, topics: TopicRegistry,
        tmp_path: Path) -> None:
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OPENFORGE_", "PYTHON"))},
           "OPENFORGE_PROXY_CREDENTIAL_KEY": KEY.decode(), "OPENFORGE_PROXY_SPOOL_DIR": str(tmp_path / "spool"),
           "OPENFORGE_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
           "OPENFORGE_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "OPENFORGE_KAFKA_PARTITIONS": str(kafka_settings.partitions),
           "PATH": f"{image_venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            "openforge", "proxy", "--host", "127.0.0.1", "--port", str(port), "--upstream", vllm_url,
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            ready: dict[str, object] = {}
            for _ in range(600):
                assert process.returncode is None, log.read_text()[-4000:]
                with contextlib.suppress(httpx.HTTPError):
                    ready = (await client.get(f"{base}/ready")).json()
                    if ready.get("engine") and ready.get("kafka"):
                        break
                await asyncio.sleep(0.1)
            assert ready.get("engine") and ready.get("kafka"), (ready, log.read_text()[-4000:])
            answer = await client.post(
                f"{base}/rollouts/r-image/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                headers={"authorization": f"Bearer {mint_token(KEY, 'r-image', Role.AGENT, 600)}"})
            assert answer.status_code == 200, answer.text
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 60)
    [event] = [e for e in await read_events(kafka_settings, topics, CALLS, expect=1) if e.rollout_id == "r-image"]
    assert isinstance(event, ModelCallV1) and len(event.prompt_token_ids) > 0 and len(event.choices[0].completion_token_ids) > 0


def test_the_dockerfile_copies_every_package_and_runs_as_the_charts_user() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = {line.split()[1].rstrip("/") for line in dockerfile.splitlines()
              if line.startswith("COPY ") and "--from" not in line}
    for source in copied:
        assert (REPO / source).exists(), source
    sourcing = [script for source in copied if source.startswith("scripts/")
                for script in (REPO / source).glob("*.sh") if "/../lib/" in script.read_text()]
    assert not sourcing or "scripts/lib" in copied, f"{sourcing[0]} sources scripts/lib, which the image leaves out"
    packages = re.search(r'include = \[(.*?)\]', (REPO / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert package in copied, f"the image leaves out the package {package}"
    values = yaml.safe_load((REPO / "helm/openforge/values.yaml").read_text())
    deployment = (REPO / "helm/openforge/templates/_deployment.tpl").read_text()
    user = re.search(r"runAsUser: (\d+)", deployment).group(1)
    group = re.search(r"runAsGroup: (\d+)", deployment).group(1)
    assert f"USER {user}:{group}" in dockerfile
    assert 'ENTRYPOINT ["openforge"]' in dockerfile  # the chart passes the process's name as args
    makefile = (REPO / "Makefile").read_text()
    assert f"IMAGE ?= {values['image']['repository']}:" in makefile
