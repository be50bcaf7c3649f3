"""The demo's learning dynamics in one process, in seconds per step: for tuning the learner's settings.

A demo run takes ten minutes of two cores and one run says little, since its timing (which
rollouts finish first, how stale each batch is) differs from run to run. This simulation keeps
what decides whether the tiny model learns and drops the rest: the demo's tiny model and learner
settings (built from :class:`~openforge.demo.DemoOptions`, exactly as the demo passes them to its
learner), the toy harness's two turns rendered with the model's chat template, the toy verifier's
score, and the learner's own :meth:`~learner.trainer.Learner.build_batch` (filtering, stuck groups,
veRL advantages) and worker step (veRL losses, rollout correction, AdamW). Rollouts are sampled
with transformers from weights ``--lag`` steps old instead of by vLLM from the served version; the
harness never forms a tool call here (a random model does not either). Sampling is seeded, so a
run repeats exactly; vary ``--sample-seed`` to see the spread.

    python -m bench.toy_sim [--seed 0] [--sample-seed 11] [--steps 50] [--lag 1] [--bonus-everywhere]

Prints one JSON line per step (batch reward, mean of the last 64 rollouts, alike and stuck groups,
entropy, an answer) and a summary line; ``--out`` writes the steps as JSON too.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from learner.grouping import Group
from learner.settings import LearnerSettings
from learner.trainer import Learner
from learner.workers.hf import HFPolicyWorker
from openforge.demo import DemoOptions, _components
from openforge.engine import install_vllm, make_tiny_model
from openforge.toy.harness import SECRET_TOOL, SYSTEM_PROMPT, tool_answer_turn
from openforge.toy.scoring import score_answer
from openforge.toy.tasks import INSTRUCTION, SECRET_WORDS
from schemas import TrajectoryV1
from schemas.trajectory.v1 import FinalizeReason, MergeStats, TrajectorySample
from stream.broker import cache_root

_WINDOW = 64  # rollouts in the demo's reward window


def learner_settings(options: DemoOptions, model_dir: Path) -> LearnerSettings:
    """The settings the demo's learner process would parse from its environment."""
    components = _components(options, Path(os.devnull), {}, "http://127.0.0.1:1", 1, model_dir)
    env = next(env for name, _, env in components if name == "learner")
    prefix = LearnerSettings.model_config.get("env_prefix", "")
    # As in the demo's learner process: the demo's values win, this environment fills the rest.
    return LearnerSettings.model_validate({k.removeprefix(prefix).lower(): v for k, v in env.items()})


class ToyLoop:
    """Sampler, learner and worker of one simulated run."""

    def __init__(self, options: DemoOptions, model_dir: Path, *, lag: int, sample_seed: int,
                 max_tokens: int = 16) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings = learner_settings(options, model_dir)
        self.learner = Learner(self.settings)  # build_batch only: nothing is started
        self.worker = HFPolicyWorker(self.settings, model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.sampler.eval()  # type: ignore[no-untyped-call]
        self.generator = torch.Generator().manual_seed(sample_seed)
        self.lag, self.max_tokens, self.group_size = lag, max_tokens, options.group_size
        self._history: deque[dict[str, torch.Tensor]] = deque(maxlen=lag + 1)
        self._history.append(copy.deepcopy(self.worker.lm.state_dict()))
        self._sampler_version = 0
        self.tasks = 0

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def _sample(self, prompt: list[int], n: int) -> list[tuple[list[int], list[float]]]:
        """``n`` completions at temperature 1 with their sampling logprobs, stopping at EOS."""
        eos = self.tokenizer.eos_token_id
        out = self.sampler(input_ids=torch.tensor([prompt] * n), use_cache=True)
        done = [False] * n
        made: list[tuple[list[int], list[float]]] = [([], []) for _ in range(n)]
        for _ in range(self.max_tokens):
            logp = torch.log_softmax(out.logits[:, -1].float(), -1)
            picked = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            for i in range(n):
                if not done[i]:
                    made[i][0].append(int(picked[i]))
                    made[i][1].append(float(logp[i, picked[i]]))
                    done[i] = int(picked[i]) == eos
            if all(done):
                break
            out = self.sampler(input_ids=picked.unsqueeze(-1), past_key_values=out.past_key_values, use_cache=True)
        return made

    def _sample_record(self, prompt: list[int], completion: tuple[list[int], list[float]]) -> TrajectorySample:
        ids, logprobs = completion
        return TrajectorySample(prompt_ids=prompt, completion_ids=ids, loss_mask=[1] * len(ids),
                                behavior_logprobs=logprobs, call_ids=[f"c{self.tasks}-{len(prompt)}"],
                                weight_versions=[{"version": str(self._sampler_version), "start": 0,
                                                  "end": len(ids)}])

    def group(self) -> tuple[Group[Any], list[str]]:
        """One task's rollouts: the toy harness's two turns, scored by the toy verifier."""
        word = SECRET_WORDS[self.tasks % len(SECRET_WORDS)]
        task_id = f"t{self.tasks}"
        self.tasks += 1
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": INSTRUCTION}]
        first_prompt = self._render(messages, [SECRET_TOOL])
        group: Group[Any] = Group(task_id, time.monotonic(), self.group_size)
        answers = []
        for index, first in enumerate(self._sample(first_prompt, self.group_size)):
            reply = str(self.tokenizer.decode(first[0], skip_special_tokens=True))
            second_prompt = self._render([*messages, {"role": "assistant", "content": reply}, tool_answer_turn(word)])
            second = self._sample(second_prompt, 1)[0]
            answer = str(self.tokenizer.decode(second[0], skip_special_tokens=True))
            answers.append(answer)
            group.members.append((TrajectoryV1(
                trajectory_id=f"tr-{task_id}-{index}", rollout_id=f"r-{task_id}-{index}", task_id=task_id,
                group_index=index, group_size=self.group_size, reward=score_answer(answer, word),
                samples=[self._sample_record(first_prompt, first), self._sample_record(second_prompt, second)],
                merge_stats=MergeStats(calls=2, merged=0, breaks=1), finalize_reason=FinalizeReason.COMPLETED,
            ), None))
        return group, answers

    def step(self, groups: list[Group[Any]]) -> dict[str, float]:
        """Train on ``groups`` as the learner would; move the sampler to the weights ``lag`` steps old."""
        batch, _ = self.learner.build_batch(groups)
        metrics: dict[str, float] = dict(batch.info)
        if batch.rows and batch.trained_tokens > 0:
            metrics.update(self.worker.train_step(batch))
            self.learner.version += 1
            self._history.append(copy.deepcopy(self.worker.lm.state_dict()))
            self.sampler.load_state_dict(self._history[0])
            self._sampler_version = max(0, self.learner.version - self.lag)
        return metrics


def main(argv: list[str] | None = None) -> int:
    """Run one simulated demo; print a line per step and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="tiny model's and learner's seed (as the demo's)")
    parser.add_argument("--sample-seed", type=int, default=11, help="seed of the simulated rollouts' sampling")
    parser.add_argument("--steps", type=int, default=50, help="learner steps (a demo run takes about 45-50)")
    parser.add_argument("--lag", type=int, default=1, help="versions between the weights that sample and train")
    parser.add_argument("--bonus-everywhere", action="store_true", help="the bonus on every token")
    parser.add_argument("--keep-alike-groups", action="store_true", help="no alike-group filter (bonus everywhere)")
    parser.add_argument("--std-advantages", action="store_true", help="GRPO's std division")
    parser.add_argument("--entropy-coeff", type=float, default=DemoOptions.entropy_coeff)
    parser.add_argument("--entropy-target", type=float, default=None, help="adaptive bonus toward this entropy")
    parser.add_argument("--lr", type=float, default=DemoOptions.lr)
    parser.add_argument("--model-dir", type=Path, default=None, help="the tiny model (default: the demo's)")
    parser.add_argument("--out", type=Path, default=None, help="write the steps as a JSON list here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.lag < 0:
        parser.error("--steps must be at least 1 and --lag not negative")
    torch.set_num_threads(1)
    options = DemoOptions(seed=args.seed, lr=args.lr, entropy_coeff=args.entropy_coeff,
                          entropy_target=args.entropy_target, norm_adv_by_std=args.std_advantages,
                          filter_alike_groups=not args.keep_alike_groups,
                          bonus_scope="all" if args.bonus_everywhere or args.keep_alike_groups else "stuck")
    model_dir = args.model_dir or cache_root() / "models" / f"tiny-seed{args.seed}"
    if not (model_dir / "config.json").exists():
        make_tiny_model(install_vllm(), model_dir, seed=args.seed)
    loop = ToyLoop(options, model_dir, lag=args.lag, sample_seed=args.sample_seed)
    groups_per_step = loop.settings.groups_per_step
    rewards: list[float] = []
    steps: list[dict[str, Any]] = []
    started = time.perf_counter()
    for step in range(args.steps):
        made = [loop.group() for _ in range(groups_per_step)]
        batch_rewards = [float(t.reward or 0.0) for g, _ in made for t, _ in g.members]
        rewards.extend(batch_rewards)
        alike = sum(len({t.reward for t, _ in g.members}) == 1 for g, _ in made)
        metrics = loop.step([g for g, _ in made])
        window = rewards[-_WINDOW:]
        record = {"step": step, "batch": round(sum(batch_rewards) / len(batch_rewards), 3),
                  "last64": round(sum(window) / len(window), 3), "alike_groups": alike,
                  "stuck": int(metrics.get("stuck_trajectories", 0)) // options.group_size,
                  "entropy": round(metrics["entropy"], 3) if "entropy" in metrics else None,
                  "version": loop.learner.version, "answer": made[-1][1][0][:40]}
        steps.append(record)
        print(json.dumps(record), flush=True)
    last = [s["last64"] for s in steps]
    reached = next((s["step"] for s in steps if s["last64"] >= DemoOptions.stop_at), None)
    print(json.dumps({"summary": True, "seed": args.seed, "sample_seed": args.sample_seed,
                      "first64": round(sum(rewards[:_WINDOW]) / min(_WINDOW, len(rewards)), 3),
                      "best64": max(last), "final64": last[-1], f"step_reaching_{DemoOptions.stop_at}": reached,
                      "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(steps), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
