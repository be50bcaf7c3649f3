"""What the demo shows: a progress line while it runs, and a reward curve with a summary at the end.

Kept apart from the process orchestration so the curve and the numbers can be tested on recorded
points without starting anything.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Curve", "RewardPoint", "Summary", "summarize", "write_plot"]


@dataclass(frozen=True)
class RewardPoint:
    """One finished rollout as the demo saw it arrive on the trajectories topic."""

    elapsed_s: float
    reward: float
    version: int | None
    """Oldest weight version that sampled any of its tokens (None when the engine reported none)."""
    task_id: str = ""
    """The rollout's task, i.e. its GRPO group."""


@dataclass
class Curve:
    """Everything the demo records while it watches the topics."""

    rewards: list[RewardPoint] = field(default_factory=list)
    checkpoints: list[tuple[float, int, dict[str, float]]] = field(default_factory=list)
    """(elapsed seconds, version, learner metrics) per checkpoint event."""
    applied: list[tuple[float, int, float]] = field(default_factory=list)
    """(elapsed seconds, version, publish seconds) per successful apply on a replica."""
    merged_turns: int = 0
    """Later calls of a rollout the assembler appended to its earlier turns (one sample)."""
    merge_breaks: int = 0
    """Later calls that started a new sample because their prompt did not extend the earlier turns."""

    @classmethod
    def read_jsonl(cls, path: Path) -> Curve:
        """The reward and checkpoint points :meth:`write_jsonl` wrote (merge counts are in the summary)."""
        curve = cls()
        for line in path.read_text(encoding="utf-8").splitlines():
            point = json.loads(line)
            kind = point.pop("kind")
            if kind == "reward":
                curve.rewards.append(RewardPoint(point["t"], point["reward"], point["version"], point["task_id"]))
            elif kind == "checkpoint":
                t, version = point.pop("t"), point.pop("version")
                curve.checkpoints.append((t, version, point))
            elif kind == "applied":
                curve.applied.append((point["t"], point["version"], point["seconds"]))
        return curve

    def write_jsonl(self, path: Path) -> None:
        """Every recorded point, one JSON object per line, for plotting elsewhere."""
        with path.open("w", encoding="utf-8") as out:
            for p in self.rewards:
                out.write(json.dumps({"kind": "reward", "t": p.elapsed_s, "reward": p.reward,
                                      "version": p.version, "task_id": p.task_id}) + "\n")
            for t, version, metrics in self.checkpoints:
                out.write(json.dumps({"kind": "checkpoint", "t": t, "version": version, **metrics}) + "\n")
            for t, version, seconds in self.applied:
                out.write(json.dumps({"kind": "applied", "t": t, "version": version, "seconds": seconds}) + "\n")

    def window_mean(self, last: int) -> float | None:
        """Mean reward of the last ``last`` rollouts (None before any arrived)."""
        values = [p.reward for p in self.rewards[-last:]]
        return statistics.fmean(values) if values else None

    def alike_groups(self, last: int) -> float | None:
        """Share of the groups among the last ``last`` rollouts whose members all scored the same.

        Such a group teaches GRPO nothing (every advantage is zero). A share near 1 means the
        policy has collapsed onto one answer per task and learning has stopped, whatever the
        reward. Groups with fewer than two members in the window are left out; None when no
        group qualifies.
        """
        judged = self._groups(last)
        if not judged:
            return None
        return sum(max(r) - min(r) < 1e-9 for r in judged) / len(judged)

    def stuck_groups(self, last: int, best: float) -> float | None:
        """Share of those groups whose members all scored the same *below* ``best``.

        The part of :meth:`alike_groups` that is a trap rather than a solved task: every
        rollout gave the same partial answer. None when no group qualifies.
        """
        judged = self._groups(last)
        if not judged:
            return None
        return sum(max(r) - min(r) < 1e-9 and max(r) < best - 1e-9 for r in judged) / len(judged)

    def _groups(self, last: int) -> list[list[float]]:
        """Rewards per task among the last ``last`` rollouts, for tasks with at least two."""
        groups: dict[str, list[float]] = {}
        for p in self.rewards[-last:]:
            if p.task_id:
                groups.setdefault(p.task_id, []).append(p.reward)
        return [rewards for rewards in groups.values() if len(rewards) >= 2]


@dataclass(frozen=True)
class Summary:
    """The demo's result in numbers; also written as JSON next to the plot."""

    rollouts: int
    duration_s: float
    reward_first: float | None
    """Mean reward of the first window of rollouts (the random policy)."""
    reward_last: float | None
    """Mean reward of the last window of rollouts."""
    window: int
    learner_steps: int
    versions_served: int
    publish_p50_s: float | None
    alike_groups_last: float | None = None
    """Share of the last window's groups in which every rollout scored the same (see
    :meth:`Curve.alike_groups`): near 1 the policy collapsed and stopped learning."""
    entropy_last: float | None = None
    """Mean token entropy (nats) of the learner's last step: how varied the sampling still is."""
    stuck_groups_last: float | None = None
    """Share of the last window's groups that are all alike *below* the verifier's best reward
    (see :meth:`Curve.stuck_groups`); None when the best reward was not given."""
    merged_share: float | None = None
    """Share of rollouts' later calls the assembler merged into one sample with the earlier turns."""
    control: bool = False
    """A control run: the learner stepped and published with learning rate 0, so the weights never changed."""

    def as_text(self) -> str:
        """A few lines for the terminal."""
        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2f}"
        return "\n".join([
            f"rollouts finished      {self.rollouts} in {self.duration_s:.0f} s",
            f"mean reward            {fmt(self.reward_first)} (first {self.window}) -> "
            f"{fmt(self.reward_last)} (last {self.window})",
            f"learner steps          {self.learner_steps}",
            f"weight versions served {self.versions_served}",
            f"publish latency p50    {fmt(self.publish_p50_s)} s",
            f"groups all alike       {fmt(self.alike_groups_last)} of the last {self.window} rollouts' groups"
            + ("" if self.stuck_groups_last is None else
               f"; {fmt(self.stuck_groups_last)} stuck below the best reward (one partial answer each), "
               f"{fmt((self.alike_groups_last or 0.0) - self.stuck_groups_last)} solved"),
            f"policy entropy         {fmt(self.entropy_last)} nats per token at the last step",
            f"turns merged           {fmt(self.merged_share)} of later calls joined their rollout's earlier turns",
        ] + (["control run            learning rate 0: the weights never changed"] if self.control else []))

    def write_json(self, path: Path) -> None:
        """Write the summary as JSON."""
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")


def summarize(curve: Curve, duration_s: float, window: int = 64, best_reward: float | None = None,
              *, control: bool = False) -> Summary:
    """Reduce a recorded curve to its summary; the window shrinks for short runs.

    ``best_reward``, the verifier's highest score, tells stuck groups from solved ones; ``control``
    marks a run that did not learn.
    """
    later_calls = curve.merged_turns + curve.merge_breaks
    n = len(curve.rewards)
    w = max(1, min(window, n // 3)) if n else window
    first = statistics.fmean(p.reward for p in curve.rewards[:w]) if n else None
    last = statistics.fmean(p.reward for p in curve.rewards[-w:]) if n else None
    steps = max((int(m.get("step", 0)) for _, _, m in curve.checkpoints), default=0)
    versions = len({v for _, v, _ in curve.applied})
    publish = [s for _, _, s in curve.applied]
    entropies = [m["entropy"] for _, _, m in curve.checkpoints if "entropy" in m]
    return Summary(rollouts=n, duration_s=duration_s, reward_first=first, reward_last=last, window=w,
                   learner_steps=steps, versions_served=versions,
                   publish_p50_s=statistics.median(publish) if publish else None,
                   alike_groups_last=curve.alike_groups(w), entropy_last=entropies[-1] if entropies else None,
                   stuck_groups_last=None if best_reward is None else curve.stuck_groups(w, best_reward),
                   merged_share=curve.merged_turns / later_calls if later_calls else None, control=control)


def _moving_mean(ys: list[float]) -> tuple[int, list[float]]:
    k = max(1, min(32, len(ys) // 5))
    return k, [statistics.fmean(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]


def write_plot(curve: Curve, path: Path, title: str, *, other: Curve | None = None, label: str = "learning",
               other_label: str = "control") -> None:
    """Plot the reward per rollout, its moving mean, the served version and the policy's entropy.

    Rewards are points with a moving-mean line, the served weight version a step line on a second
    axis; below, when the learner reported it, the entropy per step. The entropy panel is what
    tells a plateau that is still exploring from a collapsed policy. ``other``, a second run of the
    same loop (the control to a learning run, or the reverse), adds its own moving mean, so the
    two curves can be compared on one time axis.

    Raises:
        ValueError: nothing was recorded, so there is no curve to draw.
    """
    if not curve.rewards:
        raise ValueError("no rollout finished, so there is no reward curve to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.elapsed_s / 60 for p in curve.rewards]
    ys = [p.reward for p in curve.rewards]
    k, moving = _moving_mean(ys)
    entropy = sorted((t / 60, m["entropy"]) for t, _, m in curve.checkpoints if "entropy" in m)
    if entropy:
        fig, (ax, low) = plt.subplots(2, 1, figsize=(8, 6), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.scatter(xs, ys, s=6, alpha=0.25, color="tab:blue", label=f"reward per rollout, {label}")
    ax.plot(xs, moving, color="tab:blue", linewidth=2, label=f"{label}: moving mean ({k} rollouts)")
    if other is not None and other.rewards:
        other_k, other_moving = _moving_mean([p.reward for p in other.rewards])
        ax.plot([p.elapsed_s / 60 for p in other.rewards], other_moving, color="tab:red", linewidth=2,
                label=f"{other_label}: moving mean ({other_k} rollouts)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if curve.applied:
        ax2 = ax.twinx()
        points = sorted((t / 60, v) for t, v, _ in curve.applied)
        ax2.step([t for t, _ in points], [v for _, v in points], where="post", color="tab:orange",
                 alpha=0.8, label="weight version served")
        ax2.set_ylabel("weight version served", color="tab:orange")
    ax.legend(loc="upper left")
    ax.set_title(title)
    bottom = ax
    if entropy:
        low.plot([t for t, _ in entropy], [e for _, e in entropy], color="tab:green", marker=".", linewidth=1)
        low.set_ylabel("entropy\n(nats/token)")
        low.set_ylim(bottom=0)
        low.grid(alpha=0.3)
        bottom = low
    bottom.set_xlabel("minutes since the first rollout was submitted")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
