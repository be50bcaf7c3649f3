"""`openforge demo`: the whole learning loop on one machine (its options; the run is openforge.demo)."""

from __future__ import annotations

from pathlib import Path

import click

from openforge.demo import DemoOptions, run_demo

DEMO_DEFAULTS = DemoOptions()


@click.command("demo")
@click.option("--minutes", type=float, default=10.0, show_default=True,
              help="Budget of the learning phase (start-up not counted).")
@click.option("--group-size", type=int, default=8, show_default=True, help="Rollouts per task (GRPO group).")
@click.option("--max-in-flight", type=int, default=8, show_default=True, help="Rollouts running at once.")
@click.option("--stop-at", type=float, default=0.75, show_default=True,
              help="Stop early once the mean reward of the last 64 rollouts reaches this.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the tiny model's weights.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".openforge-demo"),
              show_default=True, help="Where logs, checkpoints, the plot and the summary go.")
@click.option("--keep-broker", is_flag=True, help="Leave the broker running afterwards.")
@click.option("--control", is_flag=True,
              help="Run the same loop with learning switched off (the learner steps and publishes with "
                   "learning rate 0); the plot shows the latest learning run of the same seed beside it.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=DEMO_DEFAULTS.lr, show_default=True,
              help="The learner's AdamW learning rate.")
@click.option("--entropy-coeff", type=click.FloatRange(min=0), default=DEMO_DEFAULTS.entropy_coeff,
              show_default=True, help="Weight of the learner's entropy bonus (the starting one with a target).")
@click.option("--entropy-target", type=click.FloatRange(min=0), default=DEMO_DEFAULTS.entropy_target,
              help="Steer the bonus toward this entropy (nats/token): raised below, lowered above. "
                   "Unset: the bonus stays at --entropy-coeff.")
@click.option("--fixed-entropy-coeff", is_flag=True, help="Keep the bonus at --entropy-coeff (ignore a target).")
@click.option("--bonus-everywhere", is_flag=True,
              help="Put the entropy bonus on every trained token, not only on groups stuck below the best reward.")
@click.option("--std-advantages", is_flag=True,
              help="Divide advantages by the group's reward std (GRPO) instead of not (Dr. GRPO).")
@click.option("--adam-eps", type=click.FloatRange(min=0, min_open=True), default=DEMO_DEFAULTS.adam_eps,
              show_default=True, help="The learner's AdamW epsilon.")
@click.option("--entropy-coeff-max", type=click.FloatRange(min=0), default=DEMO_DEFAULTS.entropy_coeff_max,
              show_default=True, help="Upper bound of an adaptive entropy bonus.")
@click.option("--keep-alike-groups", is_flag=True,
              help="Train on groups whose rollouts all scored the same too (implies --bonus-everywhere).")
def demo(minutes: float, group_size: int, max_in_flight: int, stop_at: float, seed: int, workdir: Path,
         keep_broker: bool, lr: float, entropy_coeff: float, entropy_target: float | None, fixed_entropy_coeff: bool,
         bonus_everywhere: bool, std_advantages: bool, adam_eps: float, entropy_coeff_max: float,
         keep_alike_groups: bool, control: bool) -> None:
    """Run the whole learning loop on one machine and plot the reward as the tiny model learns."""
    run_demo(DemoOptions(minutes=minutes, group_size=group_size, max_in_flight=max_in_flight, stop_at=stop_at,
                         seed=seed, workdir=workdir, keep_broker=keep_broker, lr=lr, entropy_coeff=entropy_coeff,
                         entropy_target=None if fixed_entropy_coeff else entropy_target,
                         norm_adv_by_std=std_advantages, adam_eps=adam_eps, entropy_coeff_max=entropy_coeff_max,
                         filter_alike_groups=not keep_alike_groups, control=control,
                         # Stuck groups are the alike ones the filter would leave out: without the
                         # filter there is nothing to single out.
                         bonus_scope="all" if bonus_everywhere or keep_alike_groups else "stuck"))
