from pathlib import Path

import pytest

from openforge.demo_report import Curve, RewardPoint, Summary, summarize, write_plot
from openforge.toy import SECRET_WORDS, score_answer, toy_tasks
from openforge.toy.tasks import ENV_WORD


@pytest.mark.parametrize(("answer", "word", "expected"), [
    ("sees", "sees", 1.0),
    ("SeEs eSs", "ess", 1.0),
    ("sxsx", "sees", 0.5),
    ("", "sees", 0.0),
    ("   \n", "sees", 0.0),
    ("xyz", "sees", 0.0),
])
def test_score_is_the_share_of_answer_characters_in_the_word(answer: str, word: str, expected: float) -> None:
    assert score_answer(answer, word) == pytest.approx(expected)


def test_a_word_without_letters_is_refused() -> None:
    with pytest.raises(ValueError, match="no letters"):
        score_answer("abc", "123")


def test_suite_has_unique_ids_and_one_letter_set() -> None:
    tasks = toy_tasks(run_id="run1", rounds=3, group_size=4, model="m")
    assert len(tasks) == 3 * len(SECRET_WORDS)
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert {frozenset(t.harness.env[ENV_WORD]) for t in tasks} == {frozenset("dim")}
    assert all(t.group_size == 4 and t.run_id == "run1" for t in tasks)


def test_summary_compares_first_and_last_windows() -> None:
    curve = Curve(rewards=[RewardPoint(float(i), 0.1 if i < 50 else 0.9, None) for i in range(100)],
                  checkpoints=[(1.0, 1, {"step": 4.0}), (2.0, 2, {"step": 8.0})],
                  applied=[(1.5, 1, 0.2), (2.5, 2, 0.4)])
    summary = summarize(curve, 120.0, window=20)
    assert (summary.reward_first, summary.reward_last) == (pytest.approx(0.1), pytest.approx(0.9))
    assert (summary.learner_steps, summary.versions_served, summary.publish_p50_s) == (8, 2, pytest.approx(0.3))
    assert "0.10 (first 20) -> 0.90 (last 20)" in summary.as_text()


def test_plot_is_a_png_and_an_empty_curve_is_refused(tmp_path: Path) -> None:
    curve = Curve(rewards=[RewardPoint(i * 3.0, i / 40, 0) for i in range(40)], applied=[(30.0, 1, 0.1)])
    write_plot(curve, tmp_path / "curve.png", "test")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no rollout finished"):
        write_plot(Curve(), tmp_path / "none.png", "test")


def test_alike_groups_spot_a_collapsed_policy() -> None:
    varied = [RewardPoint(float(i), (i % 3) / 4, None, f"t{i // 4}") for i in range(16)]
    collapsed = [RewardPoint(16.0 + i, 0.5, None, f"u{i // 4}") for i in range(16)]
    curve = Curve(rewards=varied + collapsed, checkpoints=[(1.0, 1, {"step": 1.0, "entropy": 0.25})])
    assert curve.alike_groups(16) == 1.0
    assert curve.alike_groups(32) == 0.5
    # A group cut by the window's edge counts with the members inside it; one member is not judged.
    assert Curve(rewards=[*varied[:3], RewardPoint(9.0, 0.1, None, "lonely")]).alike_groups(4) == 0.0
    assert Curve(rewards=[RewardPoint(0.0, 0.1, None, "a")]).alike_groups(4) is None
    summary = summarize(curve, 60.0, window=16)
    assert (summary.alike_groups_last, summary.entropy_last) == (1.0, 0.25)
    assert "1.00 of the last 10 rollouts' groups" in summary.as_text()  # window shrinks to n // 3


def test_the_progress_line_says_where_the_bonus_acts() -> None:
    from openforge.demo import _progress_line

    everywhere = Curve(checkpoints=[(1.0, 3, {"step": 3.0, "entropy": 2.5, "entropy_coeff": 0.02})])
    assert "entropy 2.50 (bonus 0.020) |" in _progress_line(everywhere, 5.0) + " |"
    stuck = Curve(checkpoints=[(1.0, 3, {"step": 3.0, "entropy": 0.1, "entropy_coeff": 0.02,
                                         "stuck_trajectories": 8.0})])
    assert "(bonus 0.020 on 8 stuck)" in _progress_line(stuck, 5.0)


def test_stuck_groups_are_told_from_solved_ones_by_the_best_reward() -> None:
    solved = [RewardPoint(float(i), 1.0, None, f"s{i // 4}") for i in range(8)]
    stuck = [RewardPoint(8.0 + i, 0.5, None, f"p{i // 4}") for i in range(4)]
    varied = [RewardPoint(12.0 + i, (i % 2) / 2, None, "v") for i in range(4)]
    curve = Curve(rewards=solved + stuck + varied)
    assert curve.alike_groups(16) == 0.75 and curve.stuck_groups(16, best=1.0) == 0.25
    assert curve.stuck_groups(16, best=0.5) == 0.0  # at the best reward a group is solved, not stuck
    summary = Summary(rollouts=16, duration_s=60.0, reward_first=0.1, reward_last=0.8, window=16, learner_steps=3,
                      versions_served=3, publish_p50_s=0.2, alike_groups_last=0.75, stuck_groups_last=0.25)
    assert "0.75 of the last 16 rollouts' groups; 0.25 stuck below the best reward" in summary.as_text()
    assert "0.50 solved" in summary.as_text()
    assert summarize(curve, 60.0, window=16).stuck_groups_last is None  # the best reward was not given
    assert summarize(curve, 60.0, window=16, best_reward=1.0).stuck_groups_last is not None


def test_a_curve_reads_back_what_it_wrote(tmp_path: Path) -> None:
    curve = Curve(rewards=[RewardPoint(1.0, 0.25, 0, "t1"), RewardPoint(2.0, 0.5, None, "t1")],
                  checkpoints=[(1.5, 1, {"step": 1.0, "loss": 0.1})], applied=[(1.6, 1, 0.2)])
    curve.write_jsonl(tmp_path / "curve.jsonl")
    back = Curve.read_jsonl(tmp_path / "curve.jsonl")
    assert (back.rewards, back.checkpoints, back.applied) == (curve.rewards, curve.checkpoints, curve.applied)


def test_the_plot_draws_the_other_run_and_finds_the_newest_of_that_kind(tmp_path: Path) -> None:
    import json

    from openforge.demo import latest_run

    def run(name: str, control: bool, seed: int = 0) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "options.json").write_text(json.dumps({"seed": seed, "control": control}))
        Curve(rewards=[RewardPoint(i * 3.0, 0.25, 0) for i in range(40)]).write_jsonl(folder / "curve.jsonl")
        return folder

    run("demo-1-control", True)
    newest = run("demo-2-control", True)
    run("demo-3-control", True, seed=1)
    learning = run("demo-4", False)
    assert latest_run(tmp_path, control=True, seed=0) == newest
    assert latest_run(tmp_path, control=False, seed=0) == learning
    assert latest_run(tmp_path, control=False, seed=1) is None
    curve = Curve(rewards=[RewardPoint(i * 3.0, i / 40, 0) for i in range(40)])
    write_plot(curve, tmp_path / "both.png", "test", other=Curve.read_jsonl(newest / "curve.jsonl"))
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_reports_merged_turns_and_a_control_run() -> None:
    curve = Curve(rewards=[RewardPoint(float(i), 0.25, 0) for i in range(10)], merged_turns=9, merge_breaks=1)
    summary = summarize(curve, 10.0, control=True)
    assert summary.merged_share == 0.9 and summary.control
    assert "0.90 of later calls" in summary.as_text() and "learning rate 0" in summary.as_text()
