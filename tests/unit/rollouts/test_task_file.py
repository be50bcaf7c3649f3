import orjson
from rollout_tasks import task_dict

from producers.tasks import parse_tasks


def line(data: object) -> str:
    return orjson.dumps(data).decode()


def test_valid_file_parses_every_task_and_skips_blank_lines() -> None:
    lines = [line(task_dict("a", group_size=4)), "", "   ", line(task_dict("b"))]
    tasks, errors = parse_tasks(lines)
    assert errors == []
    assert [t.task_id for t in tasks] == ["a", "b"]
    assert tasks[0].group_size == 4


def test_every_bad_line_is_reported_with_its_number() -> None:
    container_without_image = task_dict("c")
    container_without_image["harness"]["launch"] = {"kind": "container", "command": ["agent"]}
    unknown_launch = task_dict("d")
    unknown_launch["harness"]["launch"] = {"kind": "vm", "command": ["agent"]}
    lines = [
        line(task_dict("ok")),
        "{not json",
        line([1, 2]),
        line(task_dict("bad-group", group_size=0)),
        line(container_without_image),
        line(unknown_launch),
        line(task_dict("ok")),
        line({**task_dict("extra"), "surprise": 1}),
    ]
    tasks, errors = parse_tasks(lines)
    assert [e.line for e in errors] == [2, 3, 4, 5, 6, 7, 8]
    text = [str(e) for e in errors]
    assert text[0].startswith("line 2: not valid JSON")
    assert "JSON object" in text[1]
    assert "group_size" in text[2]
    assert "harness.launch.container.image" in text[3] and "Field required" in text[3]
    assert "harness.launch" in text[4] and "vm" in text[4]
    assert "already used on line 1" in text[5]
    assert "surprise" in text[6]
    assert [t.task_id for t in tasks] == ["ok"]


def test_bytes_lines_from_a_binary_file_are_accepted() -> None:
    tasks, errors = parse_tasks([line(task_dict("x")).encode() + b"\n"])
    assert not errors and tasks[0].task_id == "x"
