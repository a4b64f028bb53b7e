import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_accel.training.data import PackedBlockCollator, pack_token_ids
from hf_accel.training.heal import HealingArguments, resolve_lora_target_modules, run_healing
from tests.tiny_checkpoints import logits_in_fresh_process, sample_logits, write_tiny_llama, write_tiny_remote_model


TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40
HELD_OUT = "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles.\n" * 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("heal")
    (root / "train.txt").write_text(TEXT)
    (root / "heldout.txt").write_text(HELD_OUT)
    return {
        "root": root,
        "student": write_tiny_remote_model(root / "student", seed=1),
        "teacher": write_tiny_llama(root / "teacher", seed=0),
    }


def _kwargs(checkpoints, output_dir, **overrides):
    root = checkpoints["root"]
    kwargs = {
        "output_dir": str(output_dir),
        "model_name_or_path": str(checkpoints["student"]),
        "trust_remote_code": True,
        "teacher_model_name_or_path": str(checkpoints["teacher"]),
        "train_files": [str(root / "train.txt")],
        "validation_file": str(root / "heldout.txt"),
        "train_seq_len": 32,
        "validation_max_tokens": 128,
        "ppl_eval_steps": 2,
        "per_device_train_batch_size": 2,
        "max_steps": 4,
        "save_steps": 2,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "lora_r": 4,
        "lora_alpha": 8,
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    kwargs.update(overrides)
    return kwargs


def _args(checkpoints, output_dir, **overrides):
    return HealingArguments(**_kwargs(checkpoints, output_dir, **overrides))


def test_pack_token_ids_concatenates_with_separator_and_drops_the_tail():
    assert pack_token_ids([[5, 6, 7], [8], [9]], seq_len=3, separator_id=2) == [[5, 6, 7], [2, 8, 2]]
    assert pack_token_ids([[5, 6, 7, 8, 9]], seq_len=2) == [[5, 6], [7, 8]]
    batch = PackedBlockCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10]}])
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["attention_mask"].all()


def _short_text_packed():
    import datasets

    from hf_accel.training.data import tokenize_and_pack
    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    return tokenize_and_pack(datasets.Dataset.from_dict({"text": ["abc"]}), tokenizer, seq_len=8)


def _time_budget(minutes):
    from hf_accel.training.monitor import TimeBudgetCallback

    return TimeBudgetCallback(minutes)


def _perplexity_every(steps):
    from hf_accel.training.monitor import PerplexityCallback

    return PerplexityCallback(None, "text", steps, "history.json")


def _kd_weight(beta):
    from hf_accel.training.losses import compute_healing_loss

    return compute_healing_loss(
        torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), beta=beta
    )


def _texts(**sources):
    from hf_accel.training.data import load_text_dataset

    return load_text_dataset(**sources)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: pack_token_ids([[1, 2, 3]], 1), "seq_len must be at least 2, got 1"),
        (lambda: PackedBlockCollator()([{"input_ids": [1, 2]}, {"input_ids": [3]}]),
         "packed blocks must have one length, got lengths [1, 2]"),
        (_short_text_packed, "the training text is shorter than one block of 8 tokens"),
        (lambda: _texts(), "give exactly one of a dataset (--dataset_name) or text files (--train_files)"),
        (lambda: _texts(dataset_name="d", text_files=["t.txt"]),
         "give exactly one of a dataset (--dataset_name) or text files (--train_files)"),
        (lambda: _kd_weight(-0.5), "beta must be ≥ 0, got -0.5"),
        (lambda: _perplexity_every(0), "eval_steps must be positive, got 0"),
        (lambda: _time_budget(0), "max_minutes must be positive, got 0"),
    ],
)  # fmt: skip
def test_the_training_building_blocks_refuse_bad_values_in_one_line(build, message):
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value) == message


def test_healing_arguments_need_a_teacher_for_distillation(tmp_path):
    with pytest.raises(ValueError, match="teacher"):
        HealingArguments(output_dir=str(tmp_path), train_files=["x.txt"])
    with pytest.raises(ValueError, match="exactly one"):
        HealingArguments(output_dir=str(tmp_path), kd_beta=0.0)


def test_lora_targets_include_renamed_latent_projections(checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["student"], trust_remote_code=True)
    targets = resolve_lora_target_modules(model)
    assert "model.layers.1.self_attn.k_proj.down" in targets and "model.layers.1.self_attn.v_proj.up" in targets
    assert not any("mlp" in t or "lm_head" in t for t in targets)
    assert resolve_lora_target_modules(model, r"k_proj\.down") == [
        f"model.layers.{i}.self_attn.k_proj.down" for i in (0, 1)
    ]
    with pytest.raises(ValueError, match="matches no linear layer"):
        resolve_lora_target_modules(model, "nothing_here")
    everything = resolve_lora_target_modules(model, "all-linear")  # every linear layer but the LM head
    assert set(targets) < set(everything) and "model.layers.0.mlp.down_proj" in everything
    assert len(everything) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - 1
    assert "lm_head" not in everything and everything == sorted(everything)


@pytest.fixture(scope="module")
def lora_run(checkpoints):
    output_dir = checkpoints["root"] / "healed"
    result = run_healing(_args(checkpoints, output_dir, activation_checkpointing=True))
    return output_dir, result


def test_lora_healing_trains_merges_and_reports(checkpoints, lora_run):
    from transformers import AutoModelForCausalLM

    output_dir, result = lora_run
    summary = result.summary
    assert summary["steps"] == 4 and summary["train_tokens"] == 4 * 2 * 32
    history = json.loads((output_dir / "ppl_history.json").read_text())
    assert [p["step"] for p in history["points"]] == [0, 2, 4]
    assert history["reference_ppl"] is not None and summary["ppl"] == history["points"][-1]["ppl"]
    assert (output_dir / "ppl_curve.png").stat().st_size > 1000
    adapter_config = json.loads((output_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] is None  # not the student's local path, which gets published
    assert not (output_dir / "adapter" / "README.md").exists()  # PEFT's card names that path too
    assert json.loads((output_dir / "config.json").read_text())["use_cache"] is True  # the Trainer had turned it off
    written = json.loads((output_dir / "healing_summary.json").read_text())
    assert "output_dir" not in written and written["plot"] == "ppl_curve.png" and written["steps"] == 4
    state = json.loads((output_dir / "checkpoint-4" / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert all("kd_loss" in e and "ce_loss" in e for e in state["log_history"] if "loss" in e)

    # LoRA touched the attention projections (renamed ones included), nothing else.
    original = AutoModelForCausalLM.from_pretrained(checkpoints["student"], trust_remote_code=True).state_dict()
    merged = result.model.state_dict()
    changed = {k for k in original if not torch.equal(original[k], merged[k])}
    assert "model.layers.0.self_attn.k_proj.down.weight" in changed
    assert "model.layers.0.self_attn.v_proj.up.weight" in changed
    assert all(".self_attn." in k for k in changed)


def test_merged_checkpoint_reloads_identically_in_a_fresh_process(lora_run, tmp_path):
    output_dir, result = lora_run
    config = json.loads((output_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_tiny_latent.TinyLatentForCausalLM"
    assert (output_dir / "modeling_tiny_latent.py").is_file()
    assert (output_dir / "configuration_tiny_latent.py").is_file()
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    logits, name = logits_in_fresh_process(str(output_dir), tmp_path / "logits.pt", env)
    assert name == "TinyLatentForCausalLM"
    torch.testing.assert_close(logits, sample_logits(result.model), rtol=1e-5, atol=1e-5)


def test_resume_from_checkpoint_continues_the_run(checkpoints, lora_run):
    output_dir, _ = lora_run
    result = run_healing(_args(checkpoints, output_dir, max_steps=6, resume_from_checkpoint="last"))
    assert result.summary["steps"] == 6
    state = json.loads((output_dir / "checkpoint-6" / "trainer_state.json").read_text())
    steps = [e["step"] for e in state["log_history"] if "loss" in e]
    assert steps == [1, 2, 3, 4, 5, 6]
    history = json.loads((output_dir / "ppl_history.json").read_text())
    assert [p["step"] for p in history["points"]] == [0, 2, 4, 6]
    # published with the model: the local teacher is named by a hash, not its path
    assert history["validation"]["reference_model"].startswith("local:")
    assert str(checkpoints["root"]) not in (output_dir / "ppl_history.json").read_text()


@pytest.mark.parametrize(
    "settings",
    [
        {"max_steps": 2},
        {"max_steps": 2, "use_lora": False},
        {"max_steps": -1, "num_train_epochs": 0.04, "gradient_accumulation_steps": 2},  # the epochs give max_steps
    ],
)
def test_a_resume_from_the_last_steps_checkpoint_finishes_as_the_uninterrupted_run(checkpoints, tmp_path, settings):
    # a kill during the final save (merge, healed weights) leaves checkpoint-N of the last step: the Trainer checks for
    # max_steps after a step only, so the resume trained step N + 1, and its summary said steps N + 1 and one more
    # batch of tokens. A constant schedule trains that step at a rate above 0 (linear and cosine end at 0 exactly).
    settings = {**settings, "save_steps": 2, "lr_scheduler_type": "constant"}
    done = run_healing(_args(checkpoints, tmp_path / "done", **settings))
    steps = done.summary["steps"]
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "done", killed)
    (killed / "healing_summary.json").unlink()
    (killed / "model.safetensors").unlink()
    shutil.rmtree(killed / "adapter", ignore_errors=True)  # LoRA's, written before the merged model
    resumed = run_healing(_args(checkpoints, killed, resume_from_checkpoint="last", **settings))
    assert {**resumed.summary, "output_dir": None, "plot": None} == {**done.summary, "output_dir": None, "plot": None}
    assert steps == 2 and not (killed / "checkpoint-3").exists()
    before, after = done.model.state_dict(), resumed.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert (killed / "healing_summary.json").read_text() == (tmp_path / "done" / "healing_summary.json").read_text()
    history = json.loads((killed / "ppl_history.json").read_text())
    assert [p["step"] for p in history["points"]] == [0, 2]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"lora_r": 8}, "lora_r=4, now 8"),
        ({"use_lora": False}, "use_lora=True, now False"),
        ({}, "model_name_or_path"),
    ],
)
def test_a_resume_with_other_model_lora_or_data_settings_is_refused_in_one_line(checkpoints, tmp_path, change, named):
    # they failed deep in the Trainer's loading: a multi-line state-dict error (lora_r), "can't find a checkpoint
    # index" (use_lora), an optimizer group mismatch (another student)
    out = tmp_path / "run"
    run_healing(_args(checkpoints, out, max_steps=2, save_steps=2, validation_file=None))
    assert json.loads((out / "checkpoint-2" / "healing_run.json").read_text())["lora_r"] == 4
    change = change or {"model_name_or_path": str(checkpoints["teacher"])}
    resumed = _args(checkpoints, out, max_steps=3, resume_from_checkpoint="last", validation_file=None, **change)
    with pytest.raises(ValueError, match=f"checkpoint-2 was trained with {named}") as error:
        run_healing(resumed)
    assert "\n" not in str(error.value)
    # the same options, a path named another way: resumed
    relative = os.path.relpath(checkpoints["student"])
    run_healing(_args(checkpoints, out, max_steps=3, resume_from_checkpoint="last", validation_file=None,
                      model_name_or_path=relative))  # fmt: skip
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3


def test_resume_settings_name_a_local_dataset_directory_by_where_it_is(tmp_path, monkeypatch):
    # `--dataset_name ./my_ds` and the same directory named by its absolute path are one run: the resume was refused
    from hf_accel.training.heal import run_settings

    (tmp_path / "my_ds").mkdir()
    monkeypatch.chdir(tmp_path)
    common = {"output_dir": str(tmp_path / "out"), "model_name_or_path": "smollm2-135m", "kd_beta": 0.0}
    common["report_to"] = "none"
    relative = run_settings(HealingArguments(dataset_name="./my_ds", **common))
    absolute = run_settings(HealingArguments(dataset_name=str(tmp_path / "my_ds"), **common))
    assert relative == absolute
    assert run_settings(HealingArguments(dataset_name="karpathy/tiny_shakespeare", **common))["dataset_name"] == (
        "karpathy/tiny_shakespeare"
    )


def test_resume_settings_of_full_fine_tuning_leave_the_lora_options_out(tmp_path):
    # without LoRA its rank, alpha and targets shape nothing: a full fine-tuning resumed with another --lora_r was
    # refused as trained with other options
    from hf_accel.training.heal import run_settings

    common = {"output_dir": str(tmp_path / "out"), "model_name_or_path": "smollm2-135m", "kd_beta": 0.0}
    (tmp_path / "train.txt").write_text(TEXT)
    common.update(report_to="none", train_files=[str(tmp_path / "train.txt")], use_lora=False)
    assert run_settings(HealingArguments(**common)) == run_settings(HealingArguments(lora_r=8, **common))
    lora = dict(common, use_lora=True)
    assert run_settings(HealingArguments(**lora)) != run_settings(HealingArguments(lora_r=8, **lora))


def test_a_resume_with_another_validation_text_starts_a_new_curve(checkpoints, tmp_path):
    # the resumed run kept the teacher's perplexity and the points measured on the old text, and drew them on one
    # curve with its own points (and put the old reference in its summary and card)
    from hf_accel.eval.perplexity import compute_perplexity
    from tests.tiny_checkpoints import make_char_tokenizer

    out = tmp_path / "resumed"
    run_healing(_args(checkpoints, out, max_steps=2, save_steps=2))
    before = json.loads((out / "ppl_history.json").read_text())
    other = tmp_path / "other.txt"
    other.write_text("Completely different validation text about cats and dogs, 12345!\n" * 6)
    result = run_healing(
        _args(checkpoints, out, max_steps=4, resume_from_checkpoint="last", validation_file=str(other))
    )
    history = json.loads((out / "ppl_history.json").read_text())
    assert [p["step"] for p in history["points"]] == [2, 4]  # not step 0, measured on the old text
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(checkpoints["teacher"])
    reference = compute_perplexity(teacher, make_char_tokenizer(), other.read_text(), 32, 128, progress=False)["ppl"]
    assert history["reference_ppl"] == pytest.approx(reference) != before["reference_ppl"]
    assert result.summary["reference_ppl"] == history["reference_ppl"]


def test_a_resume_naming_the_teacher_another_way_continues_the_curve(checkpoints, tmp_path):
    # the teacher's path is part of the validation settings: named relatively on the resume, the curve started over
    out = tmp_path / "resumed"
    run_healing(_args(checkpoints, out, max_steps=2, save_steps=2))
    before = json.loads((out / "ppl_history.json").read_text())
    relative = os.path.relpath(checkpoints["teacher"])
    run_healing(
        _args(checkpoints, out, max_steps=4, resume_from_checkpoint="last", teacher_model_name_or_path=relative)
    )
    history = json.loads((out / "ppl_history.json").read_text())
    assert [p["step"] for p in history["points"]] == [0, 2, 4]
    assert history["points"][:2] == before["points"] and history["reference_ppl"] == before["reference_ppl"]


def test_a_resume_without_the_teacher_keeps_the_students_curve(checkpoints, tmp_path):
    # loss weights may change on a resume: with --kd_beta 0 no teacher loads, so there is no reference line, but the
    # student's points were measured the same way and stay (the curve started over)
    out = tmp_path / "resumed"
    run_healing(_args(checkpoints, out, max_steps=2, save_steps=2))
    before = json.loads((out / "ppl_history.json").read_text())
    run_healing(_args(checkpoints, out, max_steps=4, resume_from_checkpoint="last", kd_beta=0.0))
    history = json.loads((out / "ppl_history.json").read_text())
    assert [p["step"] for p in history["points"]] == [0, 2, 4] and history["points"][:2] == before["points"]
    assert history["reference_ppl"] is None and history["validation"]["reference_model"] is None


def test_full_fine_tuning_without_teacher_changes_every_layer(checkpoints, tmp_path):
    args = _args(
        checkpoints,
        tmp_path / "full",
        model_name_or_path=str(checkpoints["teacher"]),
        trust_remote_code=False,
        teacher_model_name_or_path=None,
        kd_beta=0.0,
        use_lora=False,
        validation_file=None,
        max_steps=2,
        learning_rate=1e-3,
    )
    result = run_healing(args)
    assert result.summary["trainable_parameters"] == sum(p.numel() for p in result.model.parameters())
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(checkpoints["teacher"]).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
    assert not torch.equal(
        original["model.layers.0.mlp.down_proj.weight"], reloaded["model.layers.0.mlp.down_proj.weight"]
    )
    assert not (tmp_path / "full" / "adapter").exists()


def test_cli_train_heal_runs_the_same_pipeline(checkpoints, tmp_path, capsys):
    from hf_accel.cli import main

    root = checkpoints["root"]
    argv = [
        "train",
        "heal",
        "--model_name_or_path",
        str(checkpoints["teacher"]),
        "--kd_beta",
        "0",
        "--train_files",
        str(root / "train.txt"),
        "--output_dir",
        str(tmp_path / "cli"),
        "--train_seq_len",
        "32",
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--report_to",
        "none",
        "--use_cpu",
        "true",
        "--lora_r",
        "2",
        "--lora_alpha",
        "2",
        "--lora_target_modules",
        r"q_proj,v_proj",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)  # the Trainer's logs go to stderr
    assert summary["steps"] == 1 and summary["ppl"] is None
    assert json.loads((tmp_path / "cli" / "adapter" / "adapter_config.json").read_text())["r"] == 2
    # Bad options are one line on stderr and exit code 2, not a traceback.
    assert main(["train", "heal", "--train_files", "x.txt"]) == 2
    assert "needs a teacher" in capsys.readouterr().err
    train = str(checkpoints["root"] / "train.txt")
    assert main(["train", "heal", "--kd_beta", "0", "--train_files", train, "--no_such_option", "1"]) == 2
    assert "--no_such_option" in capsys.readouterr().err


def test_healing_settings_for_the_model_card(tmp_path):
    from huggingface_hub import ModelCard

    from hf_accel.hub import write_model_card
    from hf_accel.training.heal import healing_settings

    (tmp_path / "corpus.txt").write_text("text")
    args = HealingArguments(
        output_dir=str(tmp_path),
        teacher_model_name_or_path="smollm2-135m",
        train_files=[str(tmp_path / "corpus.txt")],
        learning_rate=2e-4,
        report_to="none",
    )
    settings = healing_settings(args, {"steps": 10, "train_tokens": 5120})
    assert settings["healing_kd_temperature"] == 4.0 and settings["healing_kd_beta"] == 0.5
    assert settings["healing_lora_r"] == 32 and settings["healing_train_files"] == "corpus.txt"
    assert settings["healing_train_tokens"] == 5120
    assert settings["healing_lr_scheduler_type"] == "linear" and "healing_dataset_split" not in settings
    write_model_card(tmp_path, "converted-model", "smollm2-135m", settings={"kv_keep": 0.5, **settings})
    assert "`healing_kd_beta` | `0.5`" in ModelCard.load(tmp_path / "README.md").text
    full = healing_settings(  # full fine-tuning: LoRA's options shape nothing
        HealingArguments(output_dir=str(tmp_path), kd_beta=0.0, dataset_name="d", report_to="none", use_lora=False)
    )
    assert full["healing_use_lora"] is False and not [k for k in full if k.startswith("healing_lora_")]


def test_healing_settings_name_a_local_dataset_without_its_directories(tmp_path):
    """The card is published: a `save_to_disk` directory is named by its own name, not the path it had here (as
    `--train_files` are); a Hub dataset id is kept."""
    from hf_accel.training.heal import healing_settings

    (tmp_path / "private" / "my_ds").mkdir(parents=True)
    common = {"output_dir": str(tmp_path / "out"), "teacher_model_name_or_path": "smollm2-135m", "report_to": "none"}
    args = HealingArguments(dataset_name=str(tmp_path / "private" / "my_ds"), **common)
    assert healing_settings(args)["healing_dataset_name"] == "my_ds"
    args = HealingArguments(dataset_name="karpathy/tiny_shakespeare", **common)
    assert healing_settings(args)["healing_dataset_name"] == "karpathy/tiny_shakespeare"


def test_scripts_heal_parses_healing_arguments(capsys):
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "heal.py"), run_name="heal_script")
    with pytest.raises(SystemExit) as exit_info:
        script["main"](["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--teacher_model_name_or_path" in out and "--lora_target_modules" in out and "--output_dir" in out


def test_heal_corpus_decodes_shipped_answers_with_their_tokenizer(tmp_path, capsys):
    # the shipped indexes hold the default model's token ids: another --model's tokenizer would write them as garbage
    import runpy
    from pathlib import Path

    import hf_accel
    from hf_accel.loading import load_tokenizer

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "heal_corpus.py"), run_name="x")
    assert script["main"](["--model", str(write_tiny_llama(tmp_path / "tiny")), "--out", str(tmp_path / "out")]) == 0
    cache = Path(hf_accel.__file__).parent / "data" / "indexes" / "smollm2-135m-chat-build" / "self_distill.jsonl"
    answer = json.loads(cache.read_text().splitlines()[0])["tokens"]
    expected = load_tokenizer("smollm2-135m").decode(answer, skip_special_tokens=True)
    assert len(expected) > 100 and expected in (tmp_path / "out" / "train.txt").read_text(encoding="utf-8")
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["out"] == str(tmp_path / "out")


def test_heal_corpus_refuses_a_negative_teacher_sample_count_before_loading(tmp_path, capsys, monkeypatch):
    # -5 was taken as "yes" and crashed in torch.cat of no samples, after the corpus was written
    import runpy
    from pathlib import Path

    import hf_accel.loading

    monkeypatch.setattr(hf_accel.loading, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("loaded a model"))
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "heal_corpus.py"), run_name="x")
    with pytest.raises(SystemExit) as exit_info:
        script["main"](["--out", str(tmp_path / "out"), "--teacher-samples", "-5"])
    assert exit_info.value.code == 2 and "--teacher-samples must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dataset_sources_tokenize_and_pack(tmp_path):
    import datasets

    from hf_accel.training.data import load_text_dataset, tokenize_and_pack
    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    datasets.Dataset.from_dict({"content": ["abc", "", "de"]}).save_to_disk(str(tmp_path / "saved"))
    rows = load_text_dataset(dataset_name=str(tmp_path / "saved"))
    packed = tokenize_and_pack(rows, tokenizer, seq_len=3, text_column="content")
    ids = tokenizer("abcde", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    # "abc" EOS "de" EOS: 7 tokens, two blocks of 3 (empty rows are skipped).
    assert packed["input_ids"] == [ids[:3], [eos, ids[3], ids[4]]]
    (tmp_path / "a.txt").write_text("hello")
    assert load_text_dataset(text_files=[str(tmp_path / "a.txt")])["text"] == ["hello"]
    with pytest.raises(FileNotFoundError):
        load_text_dataset(text_files=[str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="no column"):
        tokenize_and_pack(rows, tokenizer, seq_len=3)
    numbers = datasets.Dataset.from_dict({"text": ["abc"], "label": [3]})
    with pytest.raises(ValueError, match="column 'label' holds values that are not text"):
        tokenize_and_pack(numbers, tokenizer, seq_len=3, text_column="label")


def test_healing_moves_a_damaged_student_towards_its_teacher(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_accel.training.losses import compute_kd_loss
    from tests.tiny_checkpoints import make_char_tokenizer

    teacher = AutoModelForCausalLM.from_pretrained(checkpoints["teacher"]).eval()
    damaged = AutoModelForCausalLM.from_pretrained(checkpoints["teacher"])
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in damaged.model.layers:  # a crude "conversion": noisy key/value projections
            layer.self_attn.k_proj.weight.add_(0.2 * torch.randn_like(layer.self_attn.k_proj.weight))
            layer.self_attn.v_proj.weight.add_(0.2 * torch.randn_like(layer.self_attn.v_proj.weight))
    damaged.save_pretrained(tmp_path / "damaged")
    make_char_tokenizer().save_pretrained(tmp_path / "damaged")
    input_ids = make_char_tokenizer()(HELD_OUT[:64], return_tensors="pt")["input_ids"]

    def distance(model):
        with torch.no_grad():
            student_logits, teacher_logits = model.eval()(input_ids).logits, teacher(input_ids).logits
            return compute_kd_loss(student_logits, teacher_logits, input_ids, temperature=1.0).item()

    before = distance(damaged)
    args = _args(
        checkpoints,
        tmp_path / "healed",
        model_name_or_path=str(tmp_path / "damaged"),
        trust_remote_code=False,
        validation_file=None,
        kd_beta=100.0,  # distillation only, in effect: CE on this tiny text would pull away from the teacher
        kd_temperature=1.0,
        use_lora=False,
        max_steps=12,
        save_steps=100,
        learning_rate=1e-3,
    )
    after = distance(run_healing(args).model)
    assert after < 0.8 * before


def test_lora_healing_of_a_care_model_keeps_latent_caching(checkpoints, tmp_path):
    """Heal a real CARE conversion: the merged checkpoint is still a CARE model, reloads in a fresh process with the
    same logits, and its cache still holds latents (bytes per token of the converted model, half the original's)."""
    from transformers import AutoModelForCausalLM

    from hf_accel.compress.care import CareConversionConfig, run_care_conversion, save_care_model
    from hf_accel.eval.memory import measure_cache_bytes_per_token
    from tests.compress.care_helpers import tiny_calibration
    from tests.tiny_checkpoints import make_char_tokenizer

    teacher = AutoModelForCausalLM.from_pretrained(checkpoints["teacher"]).eval()
    config = CareConversionConfig(kv_keep=0.5)
    result = run_care_conversion(teacher, config=config, calibration=tiny_calibration(teacher), progress=False)
    care_dir = save_care_model(result, make_char_tokenizer(), tmp_path / "care", "org/tiny")
    healed = run_healing(_args(checkpoints, tmp_path / "healed", model_name_or_path=str(care_dir), max_steps=2)).model

    ids = torch.randint(4, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    original_bytes = measure_cache_bytes_per_token(teacher, ids)
    care_bytes = measure_cache_bytes_per_token(result.model, ids)
    assert care_bytes == original_bytes / 2
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "healed", trust_remote_code=True).eval()
    assert type(reloaded).__name__ == type(result.model).__name__ == "CareLlamaForCausalLM"
    assert measure_cache_bytes_per_token(reloaded, ids) == care_bytes
    before = result.model.state_dict()["model.layers.0.self_attn.k_down.weight"]
    assert not torch.equal(before, reloaded.state_dict()["model.layers.0.self_attn.k_down.weight"])
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    logits, name = logits_in_fresh_process(str(tmp_path / "healed"), tmp_path / "logits.pt", env)
    assert name == "CareLlamaForCausalLM"
    torch.testing.assert_close(logits, sample_logits(healed), rtol=1e-5, atol=1e-5)


def test_time_budget_stops_training_after_the_step_that_passes_it(checkpoints, tmp_path):
    result = run_healing(_args(checkpoints, tmp_path / "budget", max_steps=4, max_train_minutes=1e-9))
    assert result.summary["steps"] == 1
    history = json.loads((tmp_path / "budget" / "ppl_history.json").read_text())
    assert [p["step"] for p in history["points"]] == [0, 1]
    with pytest.raises(ValueError, match="max_train_minutes must be positive"):
        _args(checkpoints, tmp_path / "bad", max_train_minutes=0)
    with pytest.raises(ValueError, match="max_train_blocks must be positive"):  # 0 blocks: an empty training set
        _args(checkpoints, tmp_path / "bad", max_train_blocks=0)


def test_time_budget_saves_no_checkpoint_when_checkpoints_are_off(checkpoints, tmp_path):
    # as after the last step: `--save_strategy no` writes no checkpoint (it wrote one with the optimizer state)
    args = _args(checkpoints, tmp_path / "budget", max_train_minutes=1e-9, save_strategy="no", validation_file=None)
    assert run_healing(args).summary["steps"] == 1
    assert not list((tmp_path / "budget").glob("checkpoint-*"))
    assert (tmp_path / "budget" / "model.safetensors").is_file()


def test_an_interrupted_history_write_keeps_the_previous_curve(tmp_path, monkeypatch):
    # the curve is rewritten after every evaluation: a kill during that write left a truncated JSON file, which made
    # the `--resume_from_checkpoint last` that the interruption calls for fail
    from pathlib import Path
    from types import SimpleNamespace

    from hf_accel.training.monitor import PerplexityCallback, read_history
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    history_file = tmp_path / "ppl_history.json"
    callback = PerplexityCallback(make_char_tokenizer(), HELD_OUT, 1, history_file, seq_len=16, max_tokens=64)
    model = make_tiny_llama(vocab_size=VOCAB_SIZE)
    callback.on_step_end(
        None, SimpleNamespace(is_world_process_zero=True, global_step=1, num_input_tokens_seen=8), None, model=model
    )
    before = read_history(history_file)

    def killed_while_writing(self, data, *args, **kwargs):
        with open(self, "w", encoding="utf-8") as f:
            f.write(data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        callback.on_step_end(
            None,
            SimpleNamespace(is_world_process_zero=True, global_step=2, num_input_tokens_seen=16),
            None,
            model=model,
        )
    monkeypatch.undo()
    assert read_history(history_file) == before and [p["step"] for p in before["points"]] == [1]
    assert [p.name for p in tmp_path.iterdir()] == [history_file.name]  # and no partial file beside it


def test_a_nan_perplexity_is_written_as_null_in_the_history_file(tmp_path):
    # a diverged run's curve held NaN, which is no JSON: jq and JSON.parse refused the whole file
    import json
    from types import SimpleNamespace

    from hf_accel.training.monitor import PerplexityCallback, plot_perplexity_curve, read_history
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    history_file = tmp_path / "ppl_history.json"
    callback = PerplexityCallback(make_char_tokenizer(), HELD_OUT, 1, history_file, seq_len=16, max_tokens=64)
    model = make_tiny_llama(vocab_size=VOCAB_SIZE)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    state = SimpleNamespace(is_world_process_zero=True, global_step=1, num_input_tokens_seen=8)
    callback.on_step_end(None, state, None, model=model)

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    json.loads(history_file.read_text(), parse_constant=refuse)
    history = read_history(history_file)
    assert [p["ppl"] for p in history["points"]] == [None]
    plot_perplexity_curve(history, tmp_path / "ppl_curve.png")  # a resumed run plots the curve it read back


def test_a_history_of_other_settings_is_a_warning_on_the_logger_not_stdout(tmp_path, capsys):
    # it was written to stdout (tqdm.write), where `train heal --json` and a library caller's own output go, and no
    # verbosity could hide it
    from types import SimpleNamespace

    from transformers.testing_utils import CaptureLogger

    from hf_accel.log import get_logger
    from hf_accel.training import monitor
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    history_file = tmp_path / "ppl_history.json"
    state = SimpleNamespace(is_world_process_zero=True, global_step=0, num_input_tokens_seen=0)
    model = make_tiny_llama(vocab_size=VOCAB_SIZE)
    monitor.PerplexityCallback(
        make_char_tokenizer(), HELD_OUT, 1, history_file, seq_len=16, max_tokens=64
    ).on_train_begin(None, state, None, model=model)
    other = monitor.PerplexityCallback(make_char_tokenizer(), HELD_OUT, 1, history_file, seq_len=8, resume=True)
    capsys.readouterr()
    with CaptureLogger(get_logger(monitor.__name__)) as logged:
        other.on_train_begin(None, state, None, model=model)
    assert "the curve starts over" in logged.out
    assert "the curve starts over" not in capsys.readouterr().out


def test_a_resume_without_a_history_file_starts_its_curve_without_a_warning(tmp_path):
    # a run started without --validation_file and resumed with one has no history yet: it was told that the history
    # it did not have was measured on other validation settings
    from types import SimpleNamespace

    from transformers.testing_utils import CaptureLogger

    from hf_accel.log import get_logger
    from hf_accel.training import monitor
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    history_file = tmp_path / "ppl_history.json"
    assert monitor.read_history(history_file) == {"reference_ppl": None, "points": []}
    state = SimpleNamespace(is_world_process_zero=True, global_step=4, num_input_tokens_seen=64)
    model = make_tiny_llama(vocab_size=VOCAB_SIZE)
    resumed = monitor.PerplexityCallback(make_char_tokenizer(), HELD_OUT, 1, history_file, seq_len=16, resume=True)
    with CaptureLogger(get_logger(monitor.__name__)) as logged:
        resumed.on_train_begin(None, state, None, model=model)
    assert logged.out == "" and [p["step"] for p in monitor.read_history(history_file)["points"]] == [4]
    # a history without settings (an older version's) may have been measured otherwise: its curve starts over
    history_file.write_text(json.dumps({"reference_ppl": None, "points": [{"step": 2, "tokens": 32, "ppl": 9.0}]}))
    resumed = monitor.PerplexityCallback(make_char_tokenizer(), HELD_OUT, 1, history_file, seq_len=16, resume=True)
    with CaptureLogger(get_logger(monitor.__name__)) as logged:
        resumed.on_train_begin(None, state, None, model=model)
    assert "measured on other validation settings; the curve starts over" in logged.out
    assert [p["step"] for p in monitor.read_history(history_file)["points"]] == [4]


@pytest.mark.parametrize("hook", ["on_train_begin", "on_step_end", "on_train_end"])
def test_perplexity_is_measured_by_the_main_process_only(tmp_path, hook):
    from types import SimpleNamespace

    from hf_accel.training.monitor import PerplexityCallback
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    history_file = tmp_path / "ppl_history.json"
    callback = PerplexityCallback(make_char_tokenizer(), HELD_OUT, 1, history_file, seq_len=16, resume=True)
    state = SimpleNamespace(is_world_process_zero=False, global_step=2, num_input_tokens_seen=32)
    getattr(callback, hook)(None, state, None, model=make_tiny_llama(vocab_size=VOCAB_SIZE))
    assert callback.history["points"] == [] and not history_file.exists()


def test_time_budget_lets_training_go_on_within_the_budget():
    from types import SimpleNamespace

    from transformers import TrainerControl

    callback = _time_budget(60)
    callback.on_train_begin(None, None, None)
    control = TrainerControl()
    callback.on_step_end(SimpleNamespace(device=torch.device("cpu"), save_strategy="steps"), None, control)
    assert not control.should_training_stop and not control.should_save


def _merged_lora_weights(result):
    return {k: v for k, v in result.model.state_dict().items() if ".self_attn." in k}


def test_same_seed_same_healed_model(checkpoints, tmp_path):
    # LoRA's A matrices are drawn when the adapters are created, before the Trainer seeds itself.
    runs = []
    for i in (0, 1):
        torch.manual_seed(100 + i)  # whatever ran before must not matter
        runs.append(run_healing(_args(checkpoints, tmp_path / f"seed{i}", max_steps=1, validation_file=None)))
    first, second = (_merged_lora_weights(r) for r in runs)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_a_new_run_in_a_used_directory_starts_its_own_curve(checkpoints, tmp_path):
    out = tmp_path / "reused"
    out.mkdir()
    stale = {"reference_ppl": 999.0, "points": [{"step": 0, "tokens": 0, "ppl": 999.0}]}
    (out / "ppl_history.json").write_text(json.dumps(stale))
    for earlier in ("checkpoint-9", "adapter"):  # an earlier LoRA run's: `last` would resume it, push would upload it
        (out / earlier).mkdir()
        (out / earlier / "trainer_state.json").write_text("{}")
    (out / "adapter" / "adapter_config.json").write_text("{}")
    for users in ("runs/experiment/events", "checkpoint-notes/a.txt", "notes/README.md"):  # not the Trainer's: kept
        (out / users).parent.mkdir(parents=True)
        (out / users).write_text("mine")
    (out / "README.md").write_text("# my project\n")
    with pytest.raises(ValueError, match="exists and is not empty: pass --overwrite_output_dir"):
        run_healing(_args(checkpoints, out, max_steps=1))
    run_healing(_args(checkpoints, out, max_steps=1, overwrite_output_dir=True, use_lora=False))
    history = json.loads((out / "ppl_history.json").read_text())
    assert history["reference_ppl"] != 999.0 and 999.0 not in [p["ppl"] for p in history["points"]]
    assert not (out / "checkpoint-9").exists() and not (out / "adapter").exists()
    assert (out / "checkpoint-1").is_dir()
    assert all((out / users).read_text() == "mine" for users in ("runs/experiment/events", "checkpoint-notes/a.txt"))
    assert (out / "README.md").read_text() == "# my project\n"  # no card was written over it (local teacher)


def test_an_interrupted_overwrite_leaves_no_earlier_model_to_load(checkpoints, tmp_path, monkeypatch):
    # the earlier run's healed checkpoint stayed until this run's end: interrupted, the directory loaded as healed
    from hf_accel.training.heal import HealingTrainer

    out = tmp_path / "again"
    run_healing(_args(checkpoints, out, max_steps=1, validation_file=None))
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(HealingTrainer, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_healing(_args(checkpoints, out, max_steps=1, validation_file=None, overwrite_output_dir=True))
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))


def test_a_used_directory_without_checkpoints_is_not_offered_for_resuming(checkpoints, tmp_path):
    out = tmp_path / "interrupted"
    out.mkdir()
    (out / "ppl_history.json").write_text("{}")  # a run stopped before its first checkpoint
    (out / "checkpoint-2").mkdir()  # a save that was interrupted: `last` skips it
    with pytest.raises(ValueError, match="not empty: pass --overwrite_output_dir or another directory$"):
        run_healing(_args(checkpoints, out, max_steps=1))
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match="pass --overwrite_output_dir, --resume_from_checkpoint last, or another"):
        run_healing(_args(checkpoints, out, max_steps=1))
    with pytest.raises(ValueError, match="not a Trainer checkpoint"):  # refused before the models load
        run_healing(_args(checkpoints, tmp_path / "fresh", max_steps=1, resume_from_checkpoint=str(tmp_path / "nope")))


def test_lora_names_the_raw_attention_parameters_it_leaves_frozen():
    from torch import nn

    from hf_accel.training.heal import _raw_parameters_beside

    class Attention(nn.Module):  # Palu's shape: projections plus a raw key up-projection
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_down = nn.Linear(4, 4), nn.Linear(4, 2)
            self.k_up = nn.Parameter(torch.zeros(2, 4))

    model = nn.ModuleDict({"self_attn": Attention(), "mlp": nn.Linear(4, 4)})
    model.mlp.scale = nn.Parameter(torch.ones(1))  # beside a non-target: not reported
    targets = resolve_lora_target_modules(model, "attention")
    assert _raw_parameters_beside(model, targets) == ["self_attn.k_up"]


def test_lora_warns_that_raw_attention_parameters_stay_as_converted(tmp_path):
    from peft import PeftModel
    from transformers.testing_utils import CaptureLogger

    from hf_accel.log import get_logger
    from hf_accel.training import heal
    from tests.conftest import make_tiny_llama

    args = HealingArguments(output_dir=str(tmp_path), kd_beta=0.0, dataset_name="d", report_to="none", lora_r=2)
    with CaptureLogger(get_logger(heal.__name__)) as logged:
        heal.prepare_student(make_tiny_llama(), args)
    assert logged.out == ""  # plain linear projections: nothing left out
    model = make_tiny_llama()
    model.model.layers[1].self_attn.k_up = torch.nn.Parameter(torch.zeros(2, 4))  # Palu's raw key up-projection
    with CaptureLogger(get_logger(heal.__name__)) as logged:
        wrapped = heal.prepare_student(model, args)
    assert logged.out.startswith(
        "LoRA adapts linear layers only: 1 parameters held directly by those layers' modules (e.g. "
        "model.layers.1.self_attn.k_up;"
    )
    assert isinstance(wrapped, PeftModel) and not model.model.layers[1].self_attn.k_up.requires_grad


def test_train_tokens_count_a_partial_last_batch(checkpoints, tmp_path):
    args = _args(checkpoints, tmp_path / "epoch", max_steps=-1, num_train_epochs=1, max_train_blocks=5,
                 per_device_train_batch_size=4, validation_file=None)  # fmt: skip
    summary = run_healing(args).summary
    assert summary["steps"] == 2 and summary["train_tokens"] == 5 * 32


def test_a_diverged_run_writes_no_adapter_and_no_model(checkpoints, tmp_path):
    args = _args(checkpoints, tmp_path / "nan", learning_rate=1e30, max_grad_norm=0.0, kd_beta=0.0,
                 validation_file=None, max_steps=2, save_steps=100)  # fmt: skip
    with pytest.raises(ValueError, match="the healed weights are not finite"):
        run_healing(args)
    assert not (tmp_path / "nan" / "adapter").exists() and not (tmp_path / "nan" / "config.json").exists()


def test_a_run_without_training_steps_is_refused(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="nothing to train: --max_steps 0 and --num_train_epochs 0"):
        _args(checkpoints, tmp_path / "none", max_steps=0, num_train_epochs=0)
    assert _args(checkpoints, tmp_path / "epochs", max_steps=0, num_train_epochs=0.5).num_train_epochs == 0.5


@pytest.mark.parametrize("name", ["validation_seq_len", "validation_max_tokens"])
def test_validation_sizes_that_are_not_positive_are_refused(checkpoints, tmp_path, name):
    # validation_max_tokens=-5 scored all but the last 5 validation tokens, without a word
    with pytest.raises(ValueError, match=f"{name} must be positive, got -5"):
        _args(checkpoints, tmp_path / "v", **{name: -5})


@pytest.mark.parametrize(
    "option, value, message",
    [
        # NaN passed the `<= 0` checks: every loss was NaN, the run ended as "diverged"; a NaN budget never stopped
        ("kd_temperature", float("nan"), "kd_temperature must be a finite positive number, got nan"),
        ("kd_temperature", float("inf"), "kd_temperature must be a finite positive number, got inf"),
        ("kd_beta", float("nan"), "kd_beta must be a finite number ≥ 0, got nan"),
        ("kd_beta", float("inf"), "kd_beta must be a finite number ≥ 0, got inf"),
        ("max_train_minutes", float("nan"), "max_train_minutes must be positive, got nan"),
    ],
)
def test_nan_and_infinite_options_are_refused(checkpoints, tmp_path, option, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        _args(checkpoints, tmp_path / "v", **{option: value})


@pytest.mark.parametrize("name", ["train_seq_len", "validation_seq_len"])
def test_one_token_windows_are_refused_by_their_option_name(checkpoints, tmp_path, name):
    # a window of one token predicts nothing: this failed after the models had loaded, as "seq_len must be at least 2"
    with pytest.raises(ValueError, match=f"^{name} must be at least 2 tokens, got 1"):
        _args(checkpoints, tmp_path / "v", **{name: 1})


def test_label_smoothing_is_refused_not_ignored(checkpoints, tmp_path):
    # the healing loss has no label smoothing: --label_smoothing_factor trained exactly as without it, without a word
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        _args(checkpoints, tmp_path / "ls", label_smoothing_factor=0.1)
    assert _args(checkpoints, tmp_path / "ls", label_smoothing_factor=0.0).label_smoothing_factor == 0.0


def test_teacher_reference_perplexity_runs_on_the_training_device(checkpoints, tmp_path, monkeypatch):
    # the teacher loads on the CPU: its reference perplexity ran there, hours for a large teacher on a GPU run
    from transformers import AutoModelForCausalLM

    from hf_accel.eval import perplexity
    from hf_accel.training.heal import _perplexity_callback
    from tests.tiny_checkpoints import make_char_tokenizer

    devices = []

    def fake_perplexity(model, *args, **kwargs):
        devices.append(next(model.parameters()).device)
        return {"ppl": 1.0}

    monkeypatch.setattr(perplexity, "compute_perplexity", fake_perplexity)
    monkeypatch.setattr(HealingArguments, "device", property(lambda self: torch.device("meta")))  # stands for a GPU
    teacher = AutoModelForCausalLM.from_pretrained(checkpoints["teacher"])
    callback = _perplexity_callback(_args(checkpoints, tmp_path / "ref"), make_char_tokenizer(), teacher, False)
    assert callback.history["reference_ppl"] == 1.0 and devices == [torch.device("meta")]


def test_bad_lora_target_regex_is_one_line_before_loading(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="not a comma-separated list of regular expressions"):
        _args(checkpoints, tmp_path / "re", lora_target_modules="k_proj(")


def test_resume_last_skips_an_interrupted_checkpoint(tmp_path):
    from hf_accel.training.heal import _last_complete_checkpoint

    for step, complete in ((2, True), (10, True), (12, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert _last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    assert _last_complete_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("cut", ["", '{\n  "best_global_step": null,\n  "best_met'])
def test_a_checkpoint_whose_trainer_state_a_kill_cut_short_is_skipped_or_refused_in_one_line(
    checkpoints, tmp_path, cut
):
    # the Trainer writes trainer_state.json last but in place: a kill while it did left an empty or cut file, which
    # `last` took for the newest checkpoint, and the resume failed on a bare "Expecting value: line 1 column 1"
    from hf_accel.training.heal import _last_complete_checkpoint

    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text(cut)
    assert _last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    named = str(tmp_path / "checkpoint-4")
    with pytest.raises(ValueError) as error:
        run_healing(_args(checkpoints, tmp_path / "out", resume_from_checkpoint=named))
    assert str(error.value) == (
        f"--resume_from_checkpoint {named}: its trainer_state.json is cut short (a save killed while writing it); "
        "resume from an earlier checkpoint"
    )


@pytest.mark.parametrize("value", ["last", "True"])
def test_resume_last_without_a_complete_checkpoint_is_refused_in_one_line(checkpoints, tmp_path, value):
    # an interrupted save (no trainer_state.json) is no checkpoint to resume: the message said there was no
    # checkpoint-* directory at all, beside one
    out = tmp_path / "out"
    for made in (False, True):
        with pytest.raises(ValueError) as error:
            run_healing(_args(checkpoints, out, resume_from_checkpoint=value))
        assert str(error.value) == (
            f"--resume_from_checkpoint {value}: no complete checkpoint-N directory (with trainer_state.json) in {out}"
        )
        (out / "checkpoint-2").mkdir(parents=True, exist_ok=True)


def test_a_checkpoint_whose_run_settings_a_kill_cut_short_resumes(checkpoints, tmp_path, monkeypatch):
    # healing_run.json is written after the Trainer's trainer_state.json, in place: a kill while it was written left a
    # complete checkpoint that `last` picked and whose resume failed on a bare "Expecting value: line 1 column 1"
    from hf_accel.training.heal import RUN_FILE

    out, write_text = tmp_path / "run", Path.write_text

    def killed_while_writing_the_run_settings(self, data, *args, **kwargs):
        if self.parent.name == "checkpoint-2" and RUN_FILE in self.name:
            write_text(self, data[: len(data) // 2], *args, **kwargs)
            raise KeyboardInterrupt
        return write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_while_writing_the_run_settings)
    with pytest.raises(KeyboardInterrupt):
        run_healing(_args(checkpoints, out, max_steps=2, save_steps=2, validation_file=None))
    monkeypatch.undo()
    assert not (out / "checkpoint-2" / RUN_FILE).exists()  # whole or absent: a checkpoint without it resumes unchecked
    resumed = _args(checkpoints, out, max_steps=3, validation_file=None, resume_from_checkpoint="last")
    assert run_healing(resumed).summary["steps"] == 3
    # one cut by an earlier version, which wrote it in place: refused in one line that names it
    (out / "checkpoint-3" / RUN_FILE).write_text('{\n "model_name_or_path": "/tm')
    with pytest.raises(ValueError) as error:
        run_healing(_args(checkpoints, out, max_steps=4, validation_file=None, resume_from_checkpoint="last"))
    assert str(error.value) == (
        f"--resume_from_checkpoint last: {out / 'checkpoint-3' / RUN_FILE} is not valid JSON; delete it to resume "
        "without checking the run settings"
    )


def test_a_checkpoint_named_by_its_path_and_without_run_settings_resumes(checkpoints, tmp_path):
    # a checkpoint written before healing_run.json existed is resumed unchecked, here named by its path
    out = tmp_path / "run"
    run_healing(_args(checkpoints, out, max_steps=2, save_steps=2, validation_file=None))
    (out / "checkpoint-2" / "healing_run.json").unlink()
    resumed = _args(
        checkpoints, out, max_steps=3, validation_file=None, resume_from_checkpoint=str(out / "checkpoint-2")
    )
    assert run_healing(resumed).summary["steps"] == 3
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]  # continued, not started over
    assert (out / "checkpoint-3" / "healing_run.json").is_file()


def _budget_worker(rank, port, results):
    import time
    from types import SimpleNamespace

    import torch.distributed as dist
    from transformers import TrainerControl

    from hf_accel.training.monitor import TimeBudgetCallback

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        callback = TimeBudgetCallback(1.0)
        callback.start = time.monotonic() - (120.0 if rank == 1 else 0.0)  # only rank 1 is past its budget
        control = TrainerControl()
        callback.on_step_end(SimpleNamespace(device=torch.device("cpu"), save_strategy="steps"), None, control)
        results[rank] = control.should_training_stop
    finally:
        dist.destroy_process_group()


def test_time_budget_stops_every_process_at_the_same_step():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_budget_worker, args=(port, results), nprocs=2, join=True)
    assert dict(results) == {0: True, 1: True}


def _cli_options(kwargs: dict) -> list[str]:
    """`HealingArguments` keyword arguments as `scripts/heal.py` options."""
    argv = []
    for name, value in kwargs.items():
        values = value if isinstance(value, list) else [value]
        argv += [f"--{name}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return argv


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)
def test_two_processes_heal_as_one_with_the_same_global_batch(checkpoints, tmp_path):
    """`torchrun --nproc_per_node 2` (gloo DDP on the CPU) against one process with twice the per-device batch: the
    same losses, loss parts included, gradient norms and curve, and the same files, written by the main process."""
    run_healing(_args(checkpoints, tmp_path / "one", per_device_train_batch_size=4))
    repo = Path(__file__).resolve().parents[2]
    options = _cli_options(_kwargs(checkpoints, tmp_path / "two"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(repo / "scripts" / "heal.py"), *options],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) == 1  # the summary, printed by the main process only
    assert (tmp_path / "two" / "checkpoint-4" / "rng_state_1.pth").is_file()  # two processes did train

    def logged(output_dir):
        state = json.loads((output_dir / "checkpoint-4" / "trainer_state.json").read_text())
        return [
            [e[k] for k in ("loss", "grad_norm", "ce_loss", "kd_loss")] for e in state["log_history"] if "loss" in e
        ]

    def files(output_dir):
        return {str(p.relative_to(output_dir)) for p in output_dir.rglob("*") if "rng_state" not in p.name}

    def read(output_dir, name):
        return json.loads((output_dir / name).read_text())

    assert logged(tmp_path / "two") == [pytest.approx(row, rel=1e-4) for row in logged(tmp_path / "one")]
    points = read(tmp_path / "one", "ppl_history.json")["points"]
    expected = [{**p, "ppl": pytest.approx(p["ppl"], rel=1e-4)} for p in points]
    assert read(tmp_path / "two", "ppl_history.json")["points"] == expected
    summary = read(tmp_path / "one", "healing_summary.json")
    assert read(tmp_path / "two", "healing_summary.json") == {
        **summary,
        "ppl": pytest.approx(summary["ppl"], rel=1e-4),
    }
    assert files(tmp_path / "two") == files(tmp_path / "one")


def test_a_bfloat16_student_is_healed_in_float32_and_saved_in_bfloat16(checkpoints, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(
        checkpoints["student"], trust_remote_code=True, dtype=torch.bfloat16
    ).save_pretrained(source)
    AutoTokenizer.from_pretrained(checkpoints["student"]).save_pretrained(source)
    for name in ("configuration_tiny_latent.py", "modeling_tiny_latent.py"):
        (source / name).write_text((checkpoints["student"] / name).read_text())
    out = tmp_path / "healed"
    run_healing(_args(checkpoints, out, model_name_or_path=str(source), max_steps=1, validation_file=None))
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


def test_checkpoint_dtype_reads_a_hub_id_from_the_cache(tmp_path, monkeypatch):
    """A student given as a Hub id keeps its declared dtype too: the config comes from the Hub cache (offline)."""
    from huggingface_hub import constants

    from hf_accel.loading import checkpoint_dtype

    snapshot = tmp_path / "models--org--student" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    (tmp_path / "models--org--student" / "refs").mkdir()
    (tmp_path / "models--org--student" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert checkpoint_dtype("org/student") == torch.bfloat16
    assert checkpoint_dtype("org/absent") is None


def test_output_dir_that_is_the_student_is_refused_before_loading(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="is the model .* itself"):
        run_healing(_args(checkpoints, checkpoints["student"], max_steps=1, overwrite_output_dir=True))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="--output_dir .* is an existing file"):
        run_healing(_args(checkpoints, a_file, max_steps=1))


def test_train_heal_and_its_script_report_bad_input_in_one_line(checkpoints, tmp_path, capsys):
    import runpy
    from pathlib import Path

    from hf_accel.cli import main

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "heal.py"), run_name="heal_script")
    train = str(checkpoints["root"] / "train.txt")
    common = ["--model_name_or_path", "./no-such-model", "--output_dir", str(tmp_path / "o"), "--kd_beta", "0"]
    cases = [
        (["--max_steps", "abc", "--train_files", "x.txt"], "invalid int value"),  # argparse's own error
        (["--train_files", str(tmp_path / "missing.txt")], "not found"),  # before loading the (missing) model
        (["--train_files", train, "--validation_file", str(tmp_path / "gone.txt")], "validation text file not found"),
        ([], "exactly one training source"),
        # zero steps saved the untrained student as if healed
        (["--train_files", train, "--max_steps", "0", "--num_train_epochs", "0"], "nothing to train"),
        (["--train_files", train, "--max_steps", "-5", "--num_train_epochs", "0"], "nothing to train"),
    ]
    for run in (lambda argv: main(["train", "heal", *argv]), script["main"]):
        for argv, message in cases:
            assert run(common + argv) == 2
            err = capsys.readouterr().err.strip()
            assert message in err and len(err.splitlines()) == 1, err


def test_training_text_that_is_not_utf8_is_one_line_before_loading(checkpoints, tmp_path, monkeypatch):
    import re

    from hf_accel.training import heal
    from hf_accel.training.data import check_utf8_file

    binary = tmp_path / "binary.txt"
    binary.write_bytes("déjà vu\n".encode() * 3 + b"\xff\xfe")  # 30 good bytes, multi-byte characters among them
    message = rf"training text file {re.escape(str(binary))} is not UTF-8 text: byte 30"
    for chunk_bytes in (1, 2, 3, 1 << 20):  # characters cut by a chunk boundary are not errors
        with pytest.raises(ValueError, match=message):
            check_utf8_file(str(binary), chunk_bytes)
    monkeypatch.setattr(heal, "_load_models", lambda args: pytest.fail("the models were loaded"))
    train = str(checkpoints["root"] / "train.txt")
    with pytest.raises(ValueError, match=message):  # not datasets' DatasetGenerationError, after minutes of loading
        run_healing(_args(checkpoints, tmp_path / "out", train_files=[train, str(binary)], max_steps=1))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("use_lora", [True, False])
def test_a_student_with_peft_adapters_is_refused_before_training(checkpoints, tmp_path, use_lora):
    # an adapter directory loads as its base with the adapters attached: LoRA healing trained, then failed in
    # save_pretrained; full fine-tuning saved the adapters alone as the "healed" model, its trained weights lost
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.tiny_checkpoints import make_char_tokenizer

    base = AutoModelForCausalLM.from_pretrained(checkpoints["teacher"])
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    make_char_tokenizer().save_pretrained(tmp_path / "adapter")
    args = _args(checkpoints, tmp_path / "out", model_name_or_path=str(tmp_path / "adapter"), trust_remote_code=False,
                 use_lora=use_lora, validation_file=None, max_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match="has PEFT adapters loaded .* merge them first"):
        run_healing(args)
    assert (
        not list((tmp_path / "out").glob("checkpoint-*")) and not (tmp_path / "out" / "adapter_config.json").exists()
    )


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line_naming_both(checkpoints, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny_checkpoints import TINY, make_char_tokenizer

    LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 160})).save_pretrained(tmp_path / "wide")
    make_char_tokenizer().save_pretrained(tmp_path / "wide")
    args = _args(checkpoints, tmp_path / "out", teacher_model_name_or_path=str(tmp_path / "wide"), max_steps=1)
    with pytest.raises(ValueError) as error:
        run_healing(args)
    assert str(error.value) == (
        f"the teacher {str(tmp_path / 'wide')!r} predicts 160 tokens and the student "
        f"{str(checkpoints['student'])!r} 128: distillation needs one vocabulary"
    )
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_packing_keeps_a_last_block_that_ends_the_stream_exactly():
    assert pack_token_ids([[5, 6, 7, 8]], seq_len=2) == [[5, 6], [7, 8]]
    assert pack_token_ids([[5, 6], [7]], seq_len=3, separator_id=2) == [[5, 6, 2]]
    assert pack_token_ids([[5, 6], [7, 8]], seq_len=3, separator_id=2) == [[5, 6, 2], [7, 8, 2]]


def test_logged_loss_parts_are_per_token_means_under_gradient_accumulation():
    from types import SimpleNamespace

    from hf_accel.training.heal import HealingTrainer
    from hf_accel.training.losses import compute_healing_loss

    student = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    teacher = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(2))
    # this micro-batch has 2 * 4 predictions; the accumulated batch 24: the gradient's loss is divided by 24
    accumulated = compute_healing_loss(student, teacher, labels, num_items_in_batch=24)
    own = compute_healing_loss(student, teacher, labels)  # divided by this micro-batch's 8

    trainer = SimpleNamespace(_loss_parts={"ce": [], "kd": []})
    HealingTrainer._record_parts(trainer, accumulated, labels, torch.tensor(24))
    assert trainer._loss_parts["ce"][0].item() == pytest.approx(own.ce.item(), rel=1e-6)
    assert trainer._loss_parts["kd"][0].item() == pytest.approx(own.kd.item(), rel=1e-6)
    HealingTrainer._record_parts(trainer, own, labels, None)  # not counted by the Trainer: its own per-token mean
    assert trainer._loss_parts["ce"][1].item() == pytest.approx(own.ce.item(), rel=1e-6)


def test_a_healed_card_keeps_the_conversions_settings_kv_bytes_and_ranks_plot(checkpoints, tmp_path):
    # the healed card was written from scratch: a healed CARE/Palu model's card lost the converter's settings and
    # its KV bytes-per-token table, which healing does not change
    from huggingface_hub import ModelCard

    from hf_accel.cli import main
    from hf_accel.training.heal import _carry_conversion_record, _write_card
    from tests.tiny_checkpoints import write_tiny_llama

    source = write_tiny_llama(tmp_path / "src")
    converted = tmp_path / "care"
    argv = ["convert", "care", "--model", str(source), "--kv-keep", "0.5", "--method", "svd", "--out", str(converted)]
    assert main([*argv, "--base-model", "org/tiny"]) == 0
    out = tmp_path / "healed"
    out.mkdir()
    conversion = _carry_conversion_record(converted, out)
    assert {"care_ranks.json", "care_ranks.png"} <= {p.name for p in out.iterdir()}
    args = _args(checkpoints, out, teacher_model_name_or_path="smollm2-135m", validation_file=None)
    _write_card(args, {"ppl": None, "steps": 4, "train_tokens": 256}, conversion)
    before, after = (ModelCard.load(d / "README.md").text for d in (converted, out))
    rows = [line for line in before.splitlines() if line.startswith(("| `", "| this model")) and "org/" not in line]
    assert len(rows) == 6 and all(row in after for row in rows)  # settings and bytes per token, as converted
    assert "`healing_kd_beta` | `0.5`" in after and "care_ranks.png" in after
    assert _carry_conversion_record(source, tmp_path / "plain") == {"ranks_plot": None}  # not converted: nothing


def test_a_healed_card_reports_the_validation_perplexity_on_the_files_name(checkpoints, tmp_path):
    from huggingface_hub import ModelCard

    from hf_accel.training.heal import _write_card

    args = _args(checkpoints, tmp_path, teacher_model_name_or_path="smollm2-135m")
    _write_card(args, {"ppl": 12.345678, "steps": 4, "train_tokens": 256}, {})
    (result,) = ModelCard.load(tmp_path / "README.md").data.eval_results
    assert (result.metric_type, result.metric_value, result.dataset_name) == ("perplexity", 12.3457, "heldout.txt")
    assert str(checkpoints["root"]) not in (tmp_path / "README.md").read_text()  # published: no local path


def test_an_overwrite_removes_an_earlier_runs_card_and_keeps_a_users_readme(tmp_path):
    from hf_accel.hub import write_model_card
    from hf_accel.training.heal import _remove_earlier_run

    write_model_card(tmp_path / "ours", "converted-model", "smollm2-135m", settings={"kv_keep": 0.5})
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "README.md").write_text("---\ntags: [mine]\n---\n# my project\n")
    for out in (tmp_path / "ours", tmp_path / "theirs"):
        _remove_earlier_run(out)
    assert not (tmp_path / "ours" / "README.md").exists()
    assert (tmp_path / "theirs" / "README.md").read_text() == "---\ntags: [mine]\n---\n# my project\n"


@pytest.mark.parametrize("given, kept", [("no", "all"), (False, "all"), ("non_padding", "non_padding")])
def test_healing_counts_input_tokens_unless_told_how(tmp_path, given, kept):
    # the summary, card and curve report tokens seen: counting is turned on, an explicit way of counting is kept
    common = {"output_dir": str(tmp_path), "kd_beta": 0.0, "dataset_name": "d", "report_to": "none"}
    assert HealingArguments(**common, include_num_input_tokens_seen=given).include_num_input_tokens_seen == kept


def test_evaluation_scores_the_healing_loss_and_logs_no_training_parts(tmp_path):
    import datasets
    from transformers import TrainingArguments

    from hf_accel.training.heal import HealingTrainer
    from hf_accel.training.losses import compute_healing_loss
    from tests.conftest import make_tiny_llama

    student, teacher = make_tiny_llama(seed=1), make_tiny_llama(seed=0)
    ids = torch.randint(4, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_eval_batch_size=4)
    trainer = HealingTrainer(model=student, args=args, data_collator=PackedBlockCollator(), teacher_model=teacher,
                             kd_beta=0.5, kd_temperature=4.0)  # fmt: skip
    metrics = trainer.evaluate(datasets.Dataset.from_dict({"input_ids": ids.tolist()}))
    with torch.no_grad():
        expected = compute_healing_loss(student(ids).logits, teacher(ids).logits, ids, 4.0, 0.5).loss
    assert metrics["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert trainer._loss_parts == {"ce": [], "kd": []}  # the logged ce/kd parts are the training batches'


def test_a_teacher_sharing_weights_with_the_student_is_refused(tmp_path):
    """A converted model shares the weights it keeps with its source: healing it against that same source object
    trained the teacher's MLPs along with the student's, so the distillation target moved with every step."""
    import copy

    from transformers import TrainingArguments

    from hf_accel.compress.care import convert_care
    from hf_accel.training.heal import HealingTrainer
    from tests.compress.care_helpers import make_tiny

    source = make_tiny("llama")
    student = convert_care(source, kv_keep=0.5, method="svd", progress=False)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="teacher shares weights with the student"):
        HealingTrainer(model=student, args=args, teacher_model=source)
    HealingTrainer(model=student, args=args, teacher_model=copy.deepcopy(source))
    student.requires_grad_(False)  # nothing trained is shared (e.g. LoRA adapters only): nothing to refuse
    HealingTrainer(model=student, args=args, teacher_model=source)


def test_the_loss_undoes_the_data_parallel_gradient_mean_as_trainer_does(tmp_path, monkeypatch):
    """With `num_items_in_batch` counting the tokens of every data-parallel process, the loss is scaled by the number
    of those processes: the processes divided by the tensor-parallel size (its ranks share one batch), as in
    `Trainer.compute_loss`; it scaled by every process before."""
    from transformers import TrainingArguments

    from hf_accel.training.heal import HealingTrainer
    from hf_accel.training.losses import compute_healing_loss
    from tests.conftest import make_tiny_llama

    student = make_tiny_llama(seed=1)
    ids = torch.randint(4, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = HealingTrainer(model=student, args=args, kd_beta=0.0)
    with torch.no_grad():
        expected = compute_healing_loss(student(ids).logits, None, ids, 4.0, 0.0, num_items_in_batch=60).loss
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 4))
    for tp_size, factor in [(1, 4), (2, 2), (4, 1)]:
        monkeypatch.setattr(trainer, "get_tp_size", lambda tp_size=tp_size: tp_size)
        with torch.no_grad():
            loss = trainer.compute_loss(student, {"input_ids": ids, "labels": ids}, num_items_in_batch=60)
        assert loss.item() == pytest.approx(factor * expected.item(), rel=1e-6)
