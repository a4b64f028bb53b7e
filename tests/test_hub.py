import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_accel.cli import main
from hf_accel.hub import (
    ARTIFACT_KINDS,
    HubError,
    is_hf_accel_card,
    populate_hub_cache,
    push_to_hub,
    save_artifact,
    write_model_card,
)
from tests.conftest import requires_transformers_adapters
from tests.tiny_checkpoints import logits_in_fresh_process, sample_logits, write_tiny_llama, write_tiny_remote_model


REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = REPO_ROOT / "pyproject.toml"
PERPLEXITY = {"metric_type": "perplexity", "metric_value": 12.34, "dataset_name": "tinyshakespeare"}


def _front_matter(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.mark.parametrize("kind", sorted(ARTIFACT_KINDS))
def test_every_kind_renders_a_card_with_valid_metadata(kind, tmp_path):
    from huggingface_hub import ModelCard

    write_model_card(
        tmp_path,
        kind,
        "smollm2-135m",
        repo_id="me/artifact",
        settings={"kv_keep": 0.5},
        eval_results=[PERPLEXITY],
        papers=[{"title": "A method", "arxiv": "2501.00001"}],
        tags=["extra"],
    )
    meta = _front_matter(tmp_path / "README.md")
    spec = ARTIFACT_KINDS[kind]
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta.get("base_model_relation") == spec.base_model_relation
    assert meta["library_name"] == spec.library_name
    assert {"hf-accel", "extra", "arxiv:2501.00001"} <= set(meta["tags"])
    card = ModelCard.load(tmp_path / "README.md")  # huggingface_hub's own parser and validation
    assert card.data.eval_results[0].metric_value == 12.34
    assert card.data.eval_results[0].dataset_name == "tinyshakespeare"
    assert "me/artifact" in card.text and "`kv_keep`" in card.text and "12.34" in card.text


def test_converted_model_card_shows_kv_bytes_ranks_and_healing_plots(tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([1, 2], [3, 4])
    fig.savefig(tmp_path / "ranks_elsewhere.png")
    out = tmp_path / "artifact"
    out.mkdir()
    fig.savefig(out / "ppl_curve.png")
    card = write_model_card(
        out,
        "converted-model",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        kv_bytes_per_token=11520,
        base_kv_bytes_per_token=23040,
        ranks_plot=tmp_path / "ranks_elsewhere.png",
        base_model_relation="finetune",
    )
    assert (out / "ranks_elsewhere.png").is_file()  # copied next to the card, linked relatively
    assert "![latent ranks per layer](ranks_elsewhere.png)" in card.text
    assert "(ppl_curve.png)" in card.text
    assert "| this model | 11520 |" in card.text and "50.0 %" in card.text
    assert _front_matter(out / "README.md")["base_model_relation"] == "finetune"
    assert "\n\n\n" not in card.text


def test_card_refuses_a_local_path_as_base_model(tmp_path):
    with pytest.raises(ValueError, match="Hub id"):
        write_model_card(tmp_path, "converted-model", str(tmp_path))
    with pytest.raises(ValueError, match="unknown artifact kind"):
        write_model_card(tmp_path, "nope", "org/name")
    # no base at all (a local model's `None`): the same line, not a TypeError from the path check
    with pytest.raises(ValueError, match="Hub id like ORG/NAME, got None"):
        save_artifact(tmp_path / "artifact", "converted-model", None)
    # names the Hub takes for no repository: into the metadata and the card's code snippets
    for name in ("my model", "org/name\nextra: 1", 'org/name"); import os  #', "org/{{ name }}", "org/name@main"):
        with pytest.raises(ValueError, match="Hub id like ORG/NAME"):
            write_model_card(tmp_path, "converted-model", name)


def test_saved_artifact_loads_by_repo_id_from_an_offline_hub_cache(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = write_tiny_remote_model(tmp_path / "source", seed=3)
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    artifact = save_artifact(
        tmp_path / "artifact",
        "converted-model",
        "smollm2-135m",
        model=model,
        tokenizer=tokenizer,
        repo_id="hf-accel-test/tiny-latent",
    )
    assert {"README.md", "modeling_tiny_latent.py", "configuration_tiny_latent.py"} <= set(os.listdir(artifact))
    (artifact / "checkpoint-1").mkdir()  # Trainer leftovers are not published
    (artifact / "checkpoint-1" / "optimizer.pt").write_bytes(b"x")

    cache = tmp_path / "hub"
    assert main(["push", str(artifact), "--repo-id", "hf-accel-test/tiny-latent", "--to-cache", str(cache)]) == 0
    repo = cache / "models--hf-accel-test--tiny-latent"
    commit = (repo / "refs" / "main").read_text()
    snapshot = repo / "snapshots" / commit
    assert len(commit) == 40 and (snapshot / "config.json").is_file()
    assert (snapshot / "model.safetensors").resolve().parent == (repo / "blobs").resolve()
    assert not (snapshot / "checkpoint-1").exists()
    # The same files again give the same commit (content-addressed).
    assert populate_hub_cache(artifact, "hf-accel-test/tiny-latent", cache_dir=cache) == snapshot

    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    logits, name = logits_in_fresh_process("hf-accel-test/tiny-latent", tmp_path / "logits.pt", env)
    assert name == "TinyLatentForCausalLM"
    torch.testing.assert_close(logits, sample_logits(model), rtol=1e-5, atol=1e-5)


def _cli(args, tmp_path, **env_overrides):
    """Runs `hf-accel ...` in a fresh process whose Hugging Face home is empty (no saved token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT), **env_overrides)
    return subprocess.run(
        [sys.executable, "-m", "hf_accel.cli", *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_push_without_a_token_is_one_clear_line(tmp_path):
    write_model_card(tmp_path / "artifact", "lora-adapter", "org/base")
    proc = _cli(["push", str(tmp_path / "artifact"), "--repo-id", "me/adapter"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hf-accel push: error: no Hugging Face token: run `hf auth login` or set HF_TOKEN to a token with write access"
    ]


def test_push_without_network_is_one_clear_line(tmp_path):
    # HF_HUB_OFFLINE=1 makes the client refuse before opening any connection: the no-network path, offline.
    write_model_card(tmp_path / "artifact", "lora-adapter", "org/base")
    proc = _cli(["push", str(tmp_path / "artifact"), "--repo-id", "me/adapter", "--token", "hf_not_a_token"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Hugging Face Hub" in lines[0], proc.stderr


def test_push_refuses_a_directory_without_a_card(tmp_path):
    with pytest.raises(HubError, match="README.md"):
        push_to_hub(tmp_path, "me/x", token="unused")


def test_push_prints_the_repository_it_pushed_to(tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi, RepoUrl

    calls = []
    write_model_card(tmp_path / "artifact", "lora-adapter", "org/base")
    monkeypatch.setattr(
        HfApi,
        "create_repo",
        lambda self, repo_id, **kw: calls.append(kw) or RepoUrl(f"https://huggingface.co/{repo_id}"),
    )
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: [])
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, operations, **kw: calls.append(kw))
    argv = ["push", str(tmp_path / "artifact"), "--repo-id", "me/adapter", "--token", "hf_unused", "--private"]
    assert main([*argv, "--message", "first"]) == 0
    assert capsys.readouterr().out == f"pushed {tmp_path / 'artifact'} to https://huggingface.co/me/adapter\n"
    assert calls[0]["private"] is True and calls[1]["commit_message"] == "first"


def test_a_push_the_hub_refuses_is_one_clear_line(tmp_path, monkeypatch, capsys):
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    def refuse(self, repo_id, **kwargs):
        response = httpx2.Response(403, request=httpx2.Request("POST", "https://huggingface.co/api/repos/create"))
        raise HfHubHTTPError("403 Forbidden: no write access.\nCannot access content at: https://x", response=response)

    write_model_card(tmp_path / "artifact", "lora-adapter", "org/base")
    monkeypatch.setattr(HfApi, "create_repo", refuse)
    assert main(["push", str(tmp_path / "artifact"), "--repo-id", "me/adapter", "--token", "hf_unused"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hf-accel push: error: the Hub refused the push to me/adapter: 403 Forbidden: no write access."
    ]


@pytest.mark.parametrize("to_cache", [False, True])
def test_push_of_a_missing_directory_is_one_line(tmp_path, capsys, to_cache):
    argv = ["push", str(tmp_path / "missing"), "--repo-id", "me/adapter", "--token", "hf_unused"]
    assert main([*argv, *(["--to-cache", str(tmp_path / "hub")] if to_cache else [])]) == 2
    assert capsys.readouterr().err.splitlines() == [f"hf-accel push: error: not a directory: {tmp_path / 'missing'}"]
    assert not (tmp_path / "hub").exists()


@pytest.mark.parametrize("repo_id", ["/x", "x/", "org/na me", "a/b/c", "name"])
def test_the_cache_writer_refuses_a_repo_id_the_hub_would_refuse(tmp_path, repo_id):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="repo_id must be ORG/NAME"):
        populate_hub_cache(tmp_path, repo_id, cache_dir=tmp_path / "hub")
    assert not (tmp_path / "hub").exists()


AUTO_PEFT_RELOAD = """
import sys, torch
from peft import AutoPeftModelForCausalLM
sys.path.insert(0, {tests_parent!r})
from tests.tiny_checkpoints import sample_logits
model = AutoPeftModelForCausalLM.from_pretrained({name!r}, trust_remote_code=True)
torch.save(sample_logits(model), {out!r})
"""


def _tiny_lora(base):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # init_lora_weights=False: random B, so the adapter changes the logits
    config = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM", init_lora_weights=False)
    return get_peft_model(base, config)


def test_adapter_of_a_remote_code_base_loads_by_repo_id_from_an_offline_hub_cache(tmp_path):
    # PeftModel.config is the base's, auto_map included: the adapter needs no remote code (the base repo has it),
    # and its adapter_config.json must name the base's Hub id, not the directory it was trained from.
    from transformers import AutoModelForCausalLM

    source = write_tiny_remote_model(tmp_path / "source", seed=1)
    peft = _tiny_lora(AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True))
    artifact = save_artifact(tmp_path / "adapter", "lora-adapter", "org/tiny-latent", model=peft, repo_id="me/lora")
    assert sorted(os.listdir(artifact)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert _front_matter(artifact / "README.md")["base_model"] == "org/tiny-latent"

    cache = tmp_path / "hub"
    populate_hub_cache(source, "org/tiny-latent", cache_dir=cache)
    populate_hub_cache(artifact, "me/lora", cache_dir=cache)
    shutil.rmtree(source)  # the machine loading it does not have the trainer's directory
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    script = AUTO_PEFT_RELOAD.format(tests_parent=str(REPO_ROOT), name="me/lora", out=str(tmp_path / "logits.pt"))
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), sample_logits(peft), rtol=1e-5, atol=1e-5)


def test_adapter_config_names_the_cards_base_model_not_the_local_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    local_base = write_tiny_llama(tmp_path / "local_base")
    peft = _tiny_lora(AutoModelForCausalLM.from_pretrained(local_base))
    peft.add_adapter("second", peft.peft_config["default"])  # saved in second/adapter_config.json
    artifact = save_artifact(tmp_path / "adapter", "lora-adapter", "smollm2-135m", model=peft)
    for config_file in (artifact / "adapter_config.json", artifact / "second" / "adapter_config.json"):
        assert json.loads(config_file.read_text())["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert _front_matter(artifact / "README.md")["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert peft.peft_config["default"].base_model_name_or_path == str(local_base)  # the caller's model is unchanged


@pytest.mark.parametrize("to_cache", [False, True])
def test_an_adapter_naming_its_base_by_a_local_path_is_refused_in_one_line(tmp_path, capsys, to_cache):
    # PEFT's save_pretrained writes the directory the base was loaded from: it was published as the adapter's base
    # (and in PEFT's card), and `AutoPeftModelForCausalLM.from_pretrained(REPO)` found no base on any other machine
    from transformers import AutoModelForCausalLM

    local_base = write_tiny_llama(tmp_path / "local_base")
    _tiny_lora(AutoModelForCausalLM.from_pretrained(local_base)).save_pretrained(tmp_path / "adapter")
    argv = ["push", str(tmp_path / "adapter"), "--repo-id", "me/lora", "--token", "hf_unused"]
    capsys.readouterr()  # the saves' progress bars
    assert main([*argv, *(["--to-cache", str(tmp_path / "hub")] if to_cache else [])]) == 2
    message = (
        f"hf-accel push: error: adapter_config.json names its base model by the local path {str(local_base)!r}, "
        "which would be published: save the adapter with hf_accel.hub.save_artifact(DIR, 'lora-adapter', "
        "'ORG/BASE', model=peft_model), which names the base's Hub id in it and in the card"
    )
    assert capsys.readouterr().err.splitlines() == [message]
    assert not (tmp_path / "hub").exists()


@requires_transformers_adapters
def test_adapters_loaded_into_a_transformers_model_are_saved_naming_the_cards_base_model(tmp_path):
    # `add_adapter` / `load_adapter` (and `from_pretrained` of an adapter's folder, as hf-accel loads one) give a
    # transformers model that saves its active adapter alone: it was saved as a model, naming the local directory
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    local_base = write_tiny_llama(tmp_path / "local_base")
    model = AutoModelForCausalLM.from_pretrained(local_base)
    model.add_adapter(LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False), adapter_name="x")
    artifact = save_artifact(tmp_path / "adapter", "lora-adapter", "smollm2-135m", model=model)
    config = json.loads((artifact / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model.peft_config["x"].base_model_name_or_path == str(local_base)  # the caller's model is unchanged


class _FailingModel:
    """Writes its weights, then fails the way a save can (disk full, an unserialisable config)."""

    def save_pretrained(self, output_dir):
        (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")


def test_save_artifact_is_atomic_and_adds_to_an_existing_directory(tmp_path):
    out = tmp_path / "artifact"
    with pytest.raises(OSError, match="disk full"):
        save_artifact(out, "lora-adapter", "org/base", model=_FailingModel())
    assert os.listdir(tmp_path) == []  # no half-written artifact, no temporary directory

    out.mkdir()
    (out / "ranks.png").write_bytes(b"png")
    (out / "notes.txt").write_text("kept")
    with pytest.raises(OSError, match="disk full"):
        save_artifact(out, "lora-adapter", "org/base", model=_FailingModel())
    assert sorted(os.listdir(tmp_path)) == ["artifact"] and sorted(os.listdir(out)) == ["notes.txt", "ranks.png"]

    save_artifact(out, "converted-model", "org/base", files=[out / "notes.txt"])
    assert sorted(os.listdir(tmp_path)) == ["artifact"]
    assert sorted(os.listdir(out)) == ["README.md", "notes.txt", "ranks.png"]
    assert (out / "notes.txt").read_text() == "kept"
    card = (out / "README.md").read_text()
    assert "# artifact" in card and "(ranks.png)" in card  # titled after the directory, not the temporary one


def test_a_model_without_save_pretrained_is_refused_in_one_line_before_anything_is_written(tmp_path):
    """A drafter's heads as a plain `nn.Module` failed inside the staging with an AttributeError."""
    with pytest.raises(TypeError) as err:
        save_artifact(tmp_path / "heads", "drafter-adapter", "org/base", model=torch.nn.Linear(2, 2))
    assert len(str(err.value).splitlines()) == 1 and str(err.value).endswith("a Linear has none")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "bad_card",
    [
        {"eval_results": [{"metric_type": "perplexity", "metric_value": 1.0}]},  # no dataset_name
        {"repoid": "me/typo"},  # not an argument of the card
        {"ranks_plot": "/no/such/ranks.png"},
    ],
)
def test_a_card_that_cannot_be_written_leaves_the_artifact_as_it_was(tmp_path, bad_card):
    out = save_artifact(tmp_path / "artifact", "converted-model", "org/base", files=[PYPROJECT])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "new_weights.safetensors").write_bytes(b"new")
    with pytest.raises((TypeError, ValueError, FileNotFoundError)):
        save_artifact(out, "converted-model", "other/base", files=[tmp_path / "new_weights.safetensors"], **bad_card)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no new files beside the old card


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a second filesystem (/dev/shm)")
def test_save_artifact_into_a_link_to_another_filesystem(tmp_path):
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as elsewhere:
        out = tmp_path / "out"
        out.symlink_to(elsewhere)  # e.g. a mounted volume: moves from beside the link would cross filesystems
        (tmp_path / "report.json").write_text("{}")
        save_artifact(out, "converted-model", "org/base", files=[tmp_path / "report.json"])
        assert sorted(os.listdir(elsewhere)) == ["README.md", "report.json"]


CUSTOM_GENERATE_BY_REPO_ID = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({base!r})
inputs = AutoTokenizer.from_pretrained({base!r})(["abcabcab", "xyzxyzxy"], return_tensors="pt", padding=True)
plain = model.generate(**inputs, do_sample=False, max_new_tokens=16)
ours = model.generate(**inputs, do_sample=False, max_new_tokens=16, custom_generate={repo!r}, trust_remote_code=True)
assert torch.equal(plain, ours), (plain, ours)
print(ours.speculative_stats.mean_accepted)
"""


def _tiny_index_artifact(tmp_path):
    """A tiny Llama (character tokenizer) and an `ngram` index artifact over repetitive text, with its card."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_accel.speculative.drafters.build import build_index_from_documents

    base = write_tiny_llama(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    text = ["abcabcabcabc xyzxyzxyz " * 8]
    build_index_from_documents([tokenizer(t)["input_ids"] for t in text], tokenizer, tmp_path / "idx", ["test"])
    artifact = save_artifact(tmp_path / "idx", "drafter-index", "org/base", drafter="ngram", repo_id="org/idx")
    return AutoModelForCausalLM.from_pretrained(base), tokenizer, base, artifact


def test_a_drafter_artifact_runs_from_generate_by_its_directory(tmp_path):
    from hf_accel.speculative import repo_generate

    model, tokenizer, _, artifact = _tiny_index_artifact(tmp_path)
    assert (artifact / "custom_generate" / "requirements.txt").read_text().startswith("hf-accel>=")
    assert 'custom_generate="org/idx"' in (artifact / "README.md").read_text()
    inputs = tokenizer(["abcabcab", "xyzxyzxy"], return_tensors="pt", padding=True)
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=16)
    ours = model.generate(**inputs, do_sample=False, max_new_tokens=16, custom_generate=str(artifact),
                          trust_remote_code=True)  # fmt: skip
    assert torch.equal(plain, ours)
    assert ours.speculative_stats.target_forward_passes < 16  # the index drafted, and drafts were accepted

    # transformers runs a copy of repo_generate (in its modules cache), not this module
    assert not repo_generate._drafters


def test_a_drafter_artifact_runs_on_a_remote_code_model_without_asking_on_the_terminal(tmp_path, monkeypatch):
    """A converted (trust_remote_code) model's tokenizer is read under the trust its code was loaded with: transformers
    must not stop `generate` to ask "Do you wish to run the custom code? [y/N]" (and fail when nobody answers)."""
    from transformers import AutoModelForCausalLM

    _, tokenizer, _, artifact = _tiny_index_artifact(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(write_tiny_remote_model(tmp_path / "remote"), trust_remote_code=True)
    monkeypatch.setattr("builtins.input", lambda *args: pytest.fail("generate asked whether to trust remote code"))
    inputs = tokenizer(["abcabcab", "xyzxyzxy"], return_tensors="pt", padding=True)
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=16)
    ours = model.generate(**inputs, do_sample=False, max_new_tokens=16, custom_generate=str(artifact),
                          trust_remote_code=True)  # fmt: skip
    assert torch.equal(plain, ours)


PINNED_REMOTE_MODEL_WITH_DRAFTER = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("org/remote", revision={commit!r}, trust_remote_code=True)
inputs = AutoTokenizer.from_pretrained({base!r})(["abcabcab", "xyzxyzxy"], return_tensors="pt", padding=True)
plain = model.generate(**inputs, do_sample=False, max_new_tokens=16)
ours = model.generate(**inputs, do_sample=False, max_new_tokens=16, custom_generate={artifact!r}, trust_remote_code=True)
assert torch.equal(plain, ours), (plain, ours)
"""


def test_a_drafter_artifact_runs_no_tokenizer_code_the_user_did_not_trust(tmp_path):
    """`trust_remote_code=True` for a model pinned to a reviewed commit trusts that commit's modeling code. The drafter
    read the model repository's tokenizer at its latest commit with `trust_remote_code=True` too, so code pushed there
    later (or a tokenizer `auto_map` naming another repository) ran inside `generate` without the user agreeing."""
    _, _, base, artifact = _tiny_index_artifact(tmp_path)
    cache, ran = tmp_path / "hub", tmp_path / "tokenizer-code-ran"
    reviewed = write_tiny_remote_model(tmp_path / "reviewed")
    populate_hub_cache(reviewed, "org/remote", cache_dir=cache, commit_hash="a" * 40)
    later = tmp_path / "later"
    shutil.copytree(reviewed, later)
    (later / "tokenization_later.py").write_text(
        f"open({str(ran)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass LaterTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((later / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_later.LaterTokenizer"]}
    (later / "tokenizer_config.json").write_text(json.dumps(config))
    populate_hub_cache(later, "org/remote", cache_dir=cache, commit_hash="b" * 40)  # now `main`
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    script = PINNED_REMOTE_MODEL_WITH_DRAFTER.format(commit="a" * 40, base=str(base), artifact=str(artifact))
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert not ran.exists()


PINNED_MODEL_WITH_DRAFTER = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("org/m", revision={commit!r})
tokenizer = AutoTokenizer.from_pretrained("org/m", revision={commit!r})
inputs = tokenizer(["abcabcab", "xyzxyzxy"], return_tensors="pt", padding=True)
plain = model.generate(**inputs, do_sample=False, max_new_tokens=16)
kwargs = dict(do_sample=False, max_new_tokens=16, custom_generate={artifact!r}, trust_remote_code=True)
try:
    model.generate(**inputs, **kwargs)
except ValueError as err:
    print(str(err).replace("\\n", " "))
else:
    raise AssertionError("the default branch's tokenizer passed the check")
ours = model.generate(**inputs, **kwargs, tokenizer=tokenizer)
assert torch.equal(plain, ours), (plain, ours)
"""


def test_a_drafter_on_a_pinned_model_says_which_tokenizer_it_checked(tmp_path):
    """transformers records no revision on a model: without `tokenizer=`, the drafter checks the index against the
    tokenizer of the repository's default branch, which may not be the pinned revision's. The refusal said "the
    model's tokenizer" and "rebuild the index with this model", though the index was built with the model's own; it
    says which tokenizer it checked and to pass `tokenizer=`, and that tokenizer runs."""
    _, _, _, artifact = _tiny_index_artifact(tmp_path)  # built with the character tokenizer of `base`
    cache = tmp_path / "hub"
    pinned = write_tiny_llama(tmp_path / "pinned")
    populate_hub_cache(pinned, "org/m", cache_dir=cache, commit_hash="a" * 40)
    later = tmp_path / "later"
    shutil.copytree(pinned, later)
    tokenizer = json.loads((later / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # a new tokenizer at the default branch
    (later / "tokenizer.json").write_text(json.dumps(tokenizer))
    populate_hub_cache(later, "org/m", cache_dir=cache, commit_hash="b" * 40)  # now `main`
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    script = PINNED_MODEL_WITH_DRAFTER.format(commit="a" * 40, artifact=str(artifact))
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    message = proc.stdout.strip().splitlines()[-1]
    assert "checked against the tokenizer of 'org/m' at its default branch" in message
    assert "pass that revision's tokenizer as `tokenizer=`" in message


def test_a_drafter_on_a_local_model_of_another_tokenizer_blames_no_revision(tmp_path):
    """A model loaded from a local directory has no branch nor revision: its saved tokenizer is the one checked, and
    a mismatch means the index was built for another model. The refusal said it was checked "at its default branch"
    and asked for "that revision's tokenizer"."""
    _, _, _, artifact = _tiny_index_artifact(tmp_path)  # built with the character tokenizer of `base`
    other = write_tiny_llama(tmp_path / "other")
    tokenizer_json = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(other)
    with pytest.raises(ValueError, match="Rebuild the index with this model") as err:
        model.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=4, custom_generate=str(artifact),
                       trust_remote_code=True)  # fmt: skip
    assert "default branch" not in str(err.value) and "revision" not in str(err.value)


def test_a_published_drafter_artifact_runs_from_generate_by_repo_id(tmp_path):
    _, _, base, artifact = _tiny_index_artifact(tmp_path)
    cache = tmp_path / "hub"
    snapshot = populate_hub_cache(artifact, "org/idx", cache_dir=cache)
    assert "ARTIFACT = 'org/idx'" in (snapshot / "custom_generate" / "generate.py").read_text()
    assert f"ARTIFACT = {str(artifact.resolve())!r}" in (artifact / "custom_generate" / "generate.py").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    script = CUSTOM_GENERATE_BY_REPO_ID.format(base=str(base), repo="org/idx")
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.strip().splitlines()[-1]) > 1.0


def test_the_card_of_an_index_over_a_converted_model_runs_as_written(tmp_path):
    """An index built for a model that ships its own code (a converted CARE/Palu checkpoint): the card's snippet,
    published, runs as printed; it loaded the base without `trust_remote_code=True`, which transformers refuses."""
    import re

    cache = tmp_path / "hub"
    populate_hub_cache(write_tiny_remote_model(tmp_path / "source"), "org/tiny-latent", cache_dir=cache)
    text = tmp_path / "a.txt"
    text.write_text("def fibonacci(n):\n    return n\n" * 20)
    args = ["index", "build", "--model", "org/tiny-latent", "--trust-remote-code", "--text", str(text)]
    proc = _cli([*args, "--out", str(tmp_path / "idx")], tmp_path, HF_HUB_CACHE=str(cache))
    assert proc.returncode == 0, proc.stderr
    snapshot = populate_hub_cache(tmp_path / "idx", "org/idx", cache_dir=cache)
    card = (snapshot / "README.md").read_text()
    assert "hf-accel bench generate --model org/tiny-latent --trust-remote-code " in card
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    script = snippet + "print(out.shape)"
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same card for a base without code of its own leaves the flags out
    write_model_card(tmp_path / "plain", "drafter-index", "org/base")
    assert "trust" not in (tmp_path / "plain" / "README.md").read_text().split("Or through")[1]


def test_push_points_custom_generate_at_the_repository(tmp_path, monkeypatch):
    from huggingface_hub import HfApi, RepoUrl

    _, _, _, artifact = _tiny_index_artifact(tmp_path)
    commits = []
    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, **kw: RepoUrl(f"https://huggingface.co/me/{repo_id}")
    )
    monkeypatch.setattr(
        HfApi, "create_commit", lambda self, repo_id, operations, **kw: commits.append((repo_id, operations))
    )
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: [])
    (artifact / ".ppl_history.json.tmp").write_text("{")  # a write cut short is not published
    (artifact / ".self_distill.jsonl.123.incomplete").write_text("{")  # nor one of `replace_atomically`
    push_to_hub(artifact, "idx", token="hf_unused")
    [(repo_id, operations)] = commits
    files = {op.path_in_repo: op for op in operations}
    assert repo_id == "me/idx" and {"README.md", "header.json", "custom_generate/requirements.txt"} <= set(files)
    assert ".ppl_history.json.tmp" not in files and ".self_distill.jsonl.123.incomplete" not in files
    generate = files["custom_generate/generate.py"].path_or_fileobj
    assert "ARTIFACT = 'me/idx'" in (generate if isinstance(generate, bytes) else generate.read()).decode()


def _push_over(artifact, on_hub: list[str], monkeypatch) -> list:
    """The operations of `push_to_hub(artifact)` to a repository that holds the files `on_hub`."""
    from huggingface_hub import HfApi, RepoUrl

    commits = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: RepoUrl(f"https://huggingface.co/{repo_id}"))
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, **kw: on_hub)
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, operations, **kw: commits.append(operations))
    push_to_hub(artifact, "me/m", token="hf_unused")
    [operations] = commits
    return operations


def test_a_re_push_deletes_weight_files_the_artifact_no_longer_has(tmp_path, monkeypatch):
    """A checkpoint re-saved in shards: the repository's old `model.safetensors` would be loaded before the shards."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    artifact = tmp_path / "a"
    artifact.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        (artifact / name).write_bytes(b"x")
    (artifact / "model.safetensors.index.json").write_text("{}")
    save_artifact(artifact, "converted-model", "org/base")
    on_hub = ["model.safetensors", "pytorch_model.bin", "model-00001-of-00002.safetensors", "notes.txt", "README.md"]
    operations = _push_over(artifact, on_hub, monkeypatch)
    deleted = {op.path_in_repo for op in operations if isinstance(op, CommitOperationDelete)}
    added = {op.path_in_repo for op in operations if isinstance(op, CommitOperationAdd)}
    assert deleted == {"model.safetensors", "pytorch_model.bin"}  # a user's other files stay
    assert {"model-00001-of-00002.safetensors", "model.safetensors.index.json", "README.md"} <= added


def test_a_re_push_keeps_weight_files_in_folders_the_artifact_does_not_write(tmp_path, monkeypatch):
    """Checkpoints a Trainer pushed (`hub_strategy="all_checkpoints"`) and a user's own folder (an index beside the
    model: its `sa.bin`) are not the artifact's: only stale weights where the artifact writes go (root, `adapter/`)."""
    from huggingface_hub import CommitOperationDelete

    artifact = tmp_path / "a"
    (artifact / "adapter").mkdir(parents=True)
    (artifact / "model.safetensors").write_bytes(b"x")
    (artifact / "adapter" / "adapter_model.safetensors").write_bytes(b"x")
    save_artifact(artifact, "converted-model", "org/base")
    on_hub = [
        "pytorch_model.bin",
        "adapter/adapter_model.bin",
        "checkpoint-500/model.safetensors",
        "checkpoint-500/training_args.bin",
        "ngram/sa.bin",
        "ngram/tokens.u32",
    ]
    operations = _push_over(artifact, on_hub, monkeypatch)
    deleted = {op.path_in_repo for op in operations if isinstance(op, CommitOperationDelete)}
    assert deleted == {"pytorch_model.bin", "adapter/adapter_model.bin"}


def test_a_git_clone_of_the_repository_is_pushed_without_its_git_folder(tmp_path, monkeypatch):
    """An artifact saved into a `git clone` of its Hub repository: the Hub client refuses any path under `.git/`
    (the push failed with a ValueError), and the cache writer must not publish it either."""
    from huggingface_hub import CommitOperationAdd

    artifact = tmp_path / "a"
    (artifact / ".git" / "objects").mkdir(parents=True)
    (artifact / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (artifact / ".git" / "objects" / "ab").write_bytes(b"x")
    (artifact / "adapter").mkdir()
    (artifact / "adapter" / ".git").write_text("gitdir: elsewhere\n")  # a submodule's or worktree's pointer file
    (artifact / "model.safetensors").write_bytes(b"x")
    save_artifact(artifact, "converted-model", "org/base")
    operations = _push_over(artifact, [], monkeypatch)
    assert {op.path_in_repo for op in operations if isinstance(op, CommitOperationAdd)} == {
        "README.md",
        "model.safetensors",
    }
    snapshot = populate_hub_cache(artifact, "me/m", cache_dir=tmp_path / "hub")
    assert sorted(os.listdir(snapshot)) == ["README.md", "model.safetensors"]


def test_a_folder_s_own_custom_generate_is_published_as_it_is(tmp_path, monkeypatch):
    """transformers runs any repository's `custom_generate/generate.py`; one that is no drafter's (no `ARTIFACT = `
    line to point at the repository) stopped the push and the cache write with "expected one top-level `ARTIFACT =
    ...` line"."""
    artifact = tmp_path / "model"
    write_model_card(artifact, "converted-model", "org/base")
    source = "def generate(model, *args, **kwargs):\n    return model.generate(*args, **kwargs)\n"
    (artifact / "custom_generate").mkdir()
    (artifact / "custom_generate" / "generate.py").write_text(source)
    files = {op.path_in_repo: op.path_or_fileobj for op in _push_over(artifact, [], monkeypatch)}
    assert Path(files["custom_generate/generate.py"]).read_text() == source
    snapshot = populate_hub_cache(artifact, "org/model", cache_dir=tmp_path / "hub")
    assert (snapshot / "custom_generate" / "generate.py").read_text() == source


def test_write_custom_generate_refuses_an_unknown_drafter(tmp_path):
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        save_artifact(tmp_path / "a", "drafter-index", "org/base", drafter="nope")
    assert not (tmp_path / "a").exists()


def test_repo_generate_turns_stop_strings_into_a_criterion(monkeypatch):
    """transformers drops `tokenizer=` before a callable `custom_generate`: the repository's generate.py passes stop
    strings on as a `StopStringCriteria` instead."""
    from transformers import GenerationConfig, GenerationMixin, StopStringCriteria

    from hf_accel.loading import load_tokenizer
    from hf_accel.speculative import repo_generate

    calls = []
    monkeypatch.setattr(GenerationMixin, "generate", lambda model, *args, **kwargs: calls.append(kwargs))
    tokenizer, config = load_tokenizer("smollm2-135m"), GenerationConfig(stop_strings=["\n\n"], max_new_tokens=4)
    for kwargs in ({"stop_strings": ["\n\n"]}, {"generation_config": config}):
        repo_generate.generate(object(), drafter="a drafter", tokenizer=tokenizer, **kwargs)
        [criterion] = calls.pop()["stopping_criteria"]
        assert isinstance(criterion, StopStringCriteria)
    assert config.stop_strings == ["\n\n"]  # the caller's config is left as it was
    with pytest.raises(ValueError, match="pass `tokenizer=`"):
        repo_generate.generate(object(), drafter="a drafter", stop_strings=["x"])

    # The first call builds the drafter with the model's own tokenizer; stop strings still need the call's, so the
    # first and the second call (drafter cached) answer alike.
    class Model:
        name_or_path = "a model"

    from transformers import AutoTokenizer

    from hf_accel.speculative import drafters

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    monkeypatch.setattr(drafters, "build_drafter", lambda *args: "a drafter")
    model = Model()
    for _ in range(2):
        with pytest.raises(ValueError, match="pass `tokenizer=`"):
            repo_generate.generate(model, stop_strings=["x"])
    assert repo_generate._drafters[model] == "a drafter"


def test_repo_generate_without_a_tokenizer_to_check_the_index_against_asks_for_one(tmp_path):
    """Without `tokenizer=`, the drafter's index is checked against the tokenizer of `model.name_or_path`: one that
    cannot be loaded (a model built in memory, a directory since removed) is one line asking for `tokenizer=`."""
    from hf_accel.speculative import repo_generate
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama()
    model.name_or_path = str(tmp_path / "removed")
    with pytest.raises(ValueError, match=r"^cannot load the tokenizer of '.*removed' to check the drafter") as err:
        repo_generate.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    assert str(err.value).endswith("pass `tokenizer=` to `generate`") and len(str(err.value).splitlines()) == 1
    assert model not in repo_generate._drafters


def test_repo_generate_honours_the_stop_strings_of_the_models_generation_config():
    """Stop strings saved in a model's generation_config.json: plain `generate(tokenizer=...)` stops at them, and so
    does the repository's generate.py. `generate` fills a call's config from the model's, so they reached transformers
    without the tokenizer it had dropped: "could not locate a tokenizer", though the call passed one."""
    from hf_accel.loading import load_tokenizer
    from hf_accel.speculative import repo_generate
    from hf_accel.speculative.drafters import InfinigramDrafter
    from tests.conftest import make_tiny_llama

    tokenizer = load_tokenizer("smollm2-135m")
    model = make_tiny_llama(vocab_size=len(tokenizer), initializer_range=0.5)
    input_ids = tokenizer("the cat of line 3 is tac. the cat of line", return_tensors="pt")["input_ids"]
    kwargs = {"max_new_tokens": 16, "do_sample": False, "tokenizer": tokenizer}
    free = tokenizer.decode(model.generate(input_ids, **kwargs)[0, input_ids.shape[1] :])
    model.generation_config.stop_strings = [free[len(free) // 2 :][:3]]
    reference = model.generate(input_ids, **kwargs)
    assert reference.shape[1] < input_ids.shape[1] + 16  # the stop string ends plain `generate`
    out = repo_generate.generate(model, input_ids, drafter=InfinigramDrafter(None), **kwargs)
    assert torch.equal(out, reference)


def test_only_an_hf_accel_card_counts_as_ours(tmp_path):
    write_model_card(tmp_path / "ours", "converted-model", "smollm2-135m")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "README.md").write_text("---\nlicense: mit\n---\n# a project\n")
    assert is_hf_accel_card(tmp_path / "ours" / "README.md")
    assert not is_hf_accel_card(tmp_path / "theirs" / "README.md") and not is_hf_accel_card(
        tmp_path / "none" / "README.md"
    )
    (tmp_path / "theirs" / "README.md").write_text("---\ntags: [hf-accel\n---\n")  # not YAML
    assert not is_hf_accel_card(tmp_path / "theirs" / "README.md")


def test_a_card_saved_without_a_repo_id_is_published_naming_the_repository(tmp_path):
    """`hf-accel index build` / `convert` save cards without knowing the repository: their snippets say
    `<your-namespace>/DIR` until the artifact is pushed (or put in a cache) under a real id."""
    artifact = save_artifact(tmp_path / "idx", "drafter-index", "org/base", drafter="ngram")
    assert 'custom_generate="<your-namespace>/idx"' in (artifact / "README.md").read_text()
    snapshot = populate_hub_cache(artifact, "me/my-index", cache_dir=tmp_path / "hub")
    published = (snapshot / "README.md").read_text()
    assert 'custom_generate="me/my-index"' in published and "hf download me/my-index " in published
    assert "<your-namespace>" not in published
    assert "<your-namespace>/idx" in (artifact / "README.md").read_text()  # the local card is left as it was


def test_a_card_saved_in_a_directory_whose_name_is_no_repository_name_is_published_naming_the_repository(tmp_path):
    # the placeholder once kept the directory's name: publishing replaced it up to the first space or bracket and
    # left the rest in the snippet, `from_pretrained("me/care care (v2)")`
    write_model_card(tmp_path / "my care (v2)", "converted-model", "org/base")
    assert 'from_pretrained("<your-namespace>/my-care-v2"' in (tmp_path / "my care (v2)" / "README.md").read_text()
    snapshot = populate_hub_cache(tmp_path / "my care (v2)", "me/care", cache_dir=tmp_path / "hub")
    published = (snapshot / "README.md").read_text()
    assert published.count('from_pretrained("me/care", trust_remote_code=True)') == 2, published


def test_a_cache_write_cut_short_leaves_no_blob_that_a_later_run_reuses(tmp_path, monkeypatch):
    """Blobs are named by their content's hash and a rerun keeps any blob already there: one cut short (a full disk,
    an interruption) must never sit under that name, or the rerun publishes the truncated file."""
    artifact = tmp_path / "artifact"
    write_model_card(artifact, "drafter-index", "org/base")
    (artifact / "tokens.u32").write_bytes(bytes(range(256)) * 64)
    write_bytes = Path.write_bytes

    def cut_short(self, data):
        write_bytes(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", cut_short)
    with pytest.raises(OSError, match="No space left"):
        populate_hub_cache(artifact, "me/idx", cache_dir=tmp_path / "hub")
    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    snapshot = populate_hub_cache(artifact, "me/idx", cache_dir=tmp_path / "hub")
    clean = populate_hub_cache(artifact, "me/idx", cache_dir=tmp_path / "clean")
    for name in ("README.md", "tokens.u32"):
        assert (snapshot / name).read_bytes() == (clean / name).read_bytes()
    for blob in (tmp_path / "hub" / "models--me--idx" / "blobs").iterdir():  # no leftovers either
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name


def test_a_snapshot_rewritten_under_the_same_commit_has_only_the_new_files(tmp_path):
    """With a given commit hash, a second write of changed files goes into the same snapshot: what the artifact no
    longer has (an old single-file checkpoint beside new shards, a removed folder) must go, as in a download."""
    artifact, commit = tmp_path / "artifact", "1" * 40
    write_model_card(artifact, "drafter-index", "org/base")
    (artifact / "model.safetensors").write_bytes(b"old")
    (artifact / "extra").mkdir()
    (artifact / "extra" / "notes.txt").write_text("old")
    populate_hub_cache(artifact, "me/m", cache_dir=tmp_path / "hub", commit_hash=commit)
    (artifact / "model.safetensors").unlink()
    shutil.rmtree(artifact / "extra")
    (artifact / "model-00001-of-00001.safetensors").write_bytes(b"new")
    snapshot = populate_hub_cache(artifact, "me/m", cache_dir=tmp_path / "hub", commit_hash=commit)
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")) == [
        "README.md",
        "model-00001-of-00001.safetensors",
    ]
    assert (snapshot / "model-00001-of-00001.safetensors").read_bytes() == b"new"


def test_two_processes_writing_the_same_snapshot_at_once_both_succeed(tmp_path, monkeypatch):
    """Another process populating the same cache can finish a file's link between this one's check and its own link:
    this one must neither fail nor write through that link into the blob."""
    artifact, cache = tmp_path / "artifact", tmp_path / "hub"
    write_model_card(artifact, "drafter-index", "org/base")
    (artifact / "tokens.u32").write_bytes(bytes(range(256)) * 4)
    symlink, others = os.symlink, []

    def other_process_first(src, dst, *args, **kwargs):
        if not others:  # the whole other run, once, just before this one's first link
            others.append(None)
            others[0] = populate_hub_cache(artifact, "me/idx", cache_dir=cache)
        return symlink(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "symlink", other_process_first)
    snapshot = populate_hub_cache(artifact, "me/idx", cache_dir=cache)
    assert others == [snapshot] and (snapshot / "tokens.u32").read_bytes() == (artifact / "tokens.u32").read_bytes()
    assert sorted(p.name for p in snapshot.iterdir()) == ["README.md", "tokens.u32"]


def test_auto_map_files_are_the_local_modules_only():
    from types import SimpleNamespace

    from hf_accel.hub import _auto_map_files

    config = SimpleNamespace(
        auto_map={
            "AutoConfig": "configuration_x.XConfig",
            "AutoModelForCausalLM": "org/other--modeling_other.OtherForCausalLM",  # code of another repository
            "AutoTokenizer": ["tokenization_x.XTokenizer", None],
        }
    )
    assert _auto_map_files(config) == {"configuration_x.py", "tokenization_x.py"}
    assert _auto_map_files(SimpleNamespace()) == set()


def test_an_auto_map_naming_a_path_copies_nothing_from_outside(tmp_path):
    """`auto_map` comes from a checkpoint's config.json, written by whoever published it: a reference naming a path
    (absolute, or `../` out of the model's code folder) copied a `.py` file from anywhere on this machine into the
    artifact, to be pushed with it. transformers reads only `module.Class` there, the module a file beside the
    config."""
    import inspect

    from tests.conftest import make_tiny_llama

    secret = tmp_path / "private" / "secret_settings.py"
    secret.parent.mkdir()
    secret.write_text("TOKEN = 'hf_private'\n")
    model = make_tiny_llama()
    code_dir = Path(inspect.getfile(type(model))).parent
    model.config.auto_map = {
        "AutoConfig": f"{secret.with_suffix('')}.Config",
        "AutoModelForCausalLM": f"{os.path.relpath(secret.with_suffix(''), code_dir)}.Model",
    }
    deep = tmp_path.joinpath(*["d"] * len(code_dir.parts))  # `../` counted from the code folder leads elsewhere here
    out = save_artifact(deep / "artifact", "converted-model", "org/base", model=model)
    assert not (out / "secret_settings.py").exists()
    assert "hf_private" not in "".join(p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file())


def test_published_name_names_a_local_input_by_its_own_name(tmp_path, monkeypatch):
    # `--dataset_name .` (the data in the working directory) was published with an empty name
    from hf_accel.hub import published_name

    (tmp_path / "my_ds").mkdir()
    monkeypatch.chdir(tmp_path / "my_ds")
    assert published_name(".") == published_name("./") == published_name(str(tmp_path / "my_ds")) == "my_ds"
    assert published_name("../my_ds/train.txt") == "train.txt"
    assert published_name("karpathy/tiny_shakespeare") == "karpathy/tiny_shakespeare"


@pytest.mark.parametrize("kind", sorted(ARTIFACT_KINDS))
def test_settings_with_pipes_backticks_and_line_breaks_stay_one_cell_each(kind, tmp_path):
    import re

    values = {
        "source 1": "text:notes | 2024.txt",
        "source 2": "text:my `best`\nfile.txt",
        "raw": "{{ 7 * 7 }} {% x %}",
    }
    write_model_card(tmp_path, kind, "org/base", settings=values)
    text = (tmp_path / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `") and "setting" not in line]
    assert len(rows) == len(values)  # a line break in a value would end its row
    for row, (key, value) in zip(rows, values.items()):
        cells = re.split(r"(?<!\\)\|", row)[1:-1]  # GFM splits at every unescaped pipe, in code too
        assert len(cells) == 2 and cells[0].strip() == f"`{key}`"
        code = re.fullmatch(r"(`+) ?(.*?) ?\1", cells[1].strip())
        assert code and code.group(2).replace("\\|", "|") == value.replace("\n", " ")


@pytest.mark.parametrize("kind", sorted(ARTIFACT_KINDS))
def test_evaluation_rows_and_title_stay_one_line_with_pipes_and_line_breaks(kind, tmp_path):
    # heal names the perplexity's dataset after the validation file, and the title defaults to a directory name
    import re

    result = {"metric_type": "perplexity", "metric_value": 9.5, "dataset_name": "notes | v2\nheld.txt"}
    result_split = {**result, "dataset_name": "wiki", "dataset_split": "test"}
    write_model_card(tmp_path, kind, "org/base", model_name="my\nmodel", eval_results=[result, result_split])
    lines = (tmp_path / "README.md").read_text().splitlines()
    assert "# my model" in lines
    rows = [line for line in lines if line.startswith("| perplexity")]
    assert [re.split(r"(?<!\\)\|", row)[1:-1] for row in rows] == [
        [" perplexity ", " notes \\| v2 held.txt ", " 9.5 "],
        [" perplexity ", " wiki (test) ", " 9.5 "],
    ]


def test_remote_code_copied_from_a_read_only_install_is_writable_in_the_artifact(tmp_path):
    """A package installed read-only (a system or Nix store, files 0444) passed its modes on with the copy: the
    artifact's code files could not be overwritten by a later save into it (`save_pretrained` writes them again).
    A converter's checkpoint gets the umask's modes from its atomic swap (tests/test_atomic.py)."""
    import stat

    from hf_accel.hub import copy_remote_code
    from tests.conftest import make_tiny_llama

    installed = tmp_path / "site-packages"
    installed.mkdir()
    (installed / "modeling_x.py").write_text("X = 1\n")
    for file in installed.iterdir():
        file.chmod(0o444)
    model = make_tiny_llama()
    model.config.auto_map = {"AutoModelForCausalLM": "modeling_x.X"}
    out = tmp_path / "artifact"
    out.mkdir()
    assert copy_remote_code(model, out, installed) == ["modeling_x.py"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "modeling_x.py").stat().st_mode) == 0o666 & ~umask


def test_remote_code_is_copied_once_with_the_modules_it_imports_and_a_missing_one_is_named(tmp_path):
    from hf_accel.hub import copy_remote_code
    from tests.conftest import make_tiny_llama

    code = tmp_path / "code"
    code.mkdir()
    (code / "shared_x.py").write_text("Y = 2\n")
    (code / "configuration_x.py").write_text("from .shared_x import Y\n")
    (code / "modeling_x.py").write_text("from .configuration_x import Y\nfrom .shared_x import Y\n")
    model = make_tiny_llama()
    model.config.auto_map = {"AutoConfig": "configuration_x.C", "AutoModelForCausalLM": "modeling_x.M"}
    out = tmp_path / "artifact"
    out.mkdir()
    assert copy_remote_code(model, out, code) == ["configuration_x.py", "shared_x.py", "modeling_x.py"]
    assert sorted(p.name for p in out.iterdir()) == ["configuration_x.py", "modeling_x.py", "shared_x.py"]
    model.config.auto_map["AutoTokenizer"] = "tokenization_x.T"
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        copy_remote_code(model, tmp_path / "other", code)
    assert len(str(err.value).splitlines()) == 1 and str(err.value).startswith("auto_map names tokenization_x.py")
    assert str(code) in str(err.value)
    assert list((tmp_path / "other").iterdir()) == []  # nothing copied before the missing file was found
    del model.config.auto_map["AutoTokenizer"]
    (code / "shared_x.py").write_text("from .helpers_x import Z\n")  # imported by both, through configuration_x
    with pytest.raises(FileNotFoundError) as err:
        copy_remote_code(model, tmp_path / "other", code)
    assert str(err.value) == f"configuration_x.py needs helpers_x.py (a relative import), but it is not in {code}"
    assert list((tmp_path / "other").iterdir()) == []


def test_the_cache_writer_copies_blobs_where_links_cannot_be_made(tmp_path, monkeypatch):
    # Windows without developer mode: no symlinks; the Hub client copies the blob into the snapshot too
    def no_links(self, target, target_is_directory=False):
        raise OSError(1314, "A required privilege is not held by the client")

    artifact = write_tiny_llama(tmp_path / "artifact", seed=0)
    write_model_card(artifact, "converted-model", "org/base", repo_id="org/tiny")  # published unchanged
    monkeypatch.setattr(Path, "symlink_to", no_links)
    snapshot = populate_hub_cache(artifact, "org/tiny", cache_dir=tmp_path / "hub")
    files = sorted(p.relative_to(artifact) for p in artifact.rglob("*") if p.is_file())
    assert sorted(p.relative_to(snapshot) for p in snapshot.rglob("*")) == files
    for name in files:
        assert not (snapshot / name).is_symlink() and (snapshot / name).read_bytes() == (artifact / name).read_bytes()


def test_a_card_takes_evaluation_results_as_eval_result_objects(tmp_path):
    from huggingface_hub import EvalResult

    result = EvalResult(
        task_type="text-generation", dataset_type="wikitext", dataset_name="wikitext", metric_type="perplexity",
        metric_value=9.87, dataset_split="test",
    )  # fmt: skip
    card = write_model_card(tmp_path / "m", "converted-model", "org/base", eval_results=[result, PERPLEXITY])
    assert card.data.eval_results == [result, EvalResult(task_type="text-generation", dataset_type="tinyshakespeare",
                                                         **PERPLEXITY)]  # fmt: skip
    assert "| perplexity | wikitext (test) | 9.87 |" in (tmp_path / "m" / "README.md").read_text()


def test_push_to_cache_prints_a_setting_that_works_from_any_directory(tmp_path, monkeypatch, capsys):
    """`--to-cache "my cache"` printed `HF_HUB_CACHE=my cache`: pasted into a shell it runs a command `cache`, and a
    relative cache only works from the directory the push ran in."""
    import shlex

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    write_model_card(artifact, "drafter-index", "smollm2-135m")
    monkeypatch.chdir(tmp_path)
    assert main(["push", "artifact", "--repo-id", "org/tiny", "--to-cache", "my cache"]) == 0
    setting = shlex.split(capsys.readouterr().out.split("load with ", 1)[1])[0]
    assert setting == f"HF_HUB_CACHE={tmp_path / 'my cache'}"
    assert (tmp_path / "my cache" / "models--org--tiny").is_dir()


def test_a_custom_template_written_against_eval_results_still_gets_them(tmp_path):
    # the shipped templates moved to escaped `eval_rows`; a user's `template_dir` lost its evaluation table silently
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "converted_model.md").write_text(
        "---\n{{ card_data }}\n---\n{% for r in eval_results %}{{ r.metric_type }}={{ r.metric_value }}\n{% endfor %}"
    )
    result = {"metric_type": "perplexity", "metric_value": 9.5, "dataset_name": "wiki"}
    write_model_card(tmp_path / "out", "converted-model", "org/base", eval_results=[result], template_dir=templates)
    assert "perplexity=9.5" in (tmp_path / "out" / "README.md").read_text()


def test_a_missing_model_card_template_is_one_line_naming_it(tmp_path, monkeypatch):
    """An install without hf-accel's `hub_cards/` (a wheel's data files dropped by a repackager) wrote no card and
    raised the template reader's error; it now says what is missing and, for the shipped templates, what to do."""
    from hf_accel import hub

    monkeypatch.setattr(hub, "HUB_CARDS_DIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"^no model-card template .*nowhere.*reinstall hf-accel\)$"):
        hub.write_model_card(tmp_path / "out", "converted-model", "org/base")
    with pytest.raises(FileNotFoundError, match=r"^no model-card template .*mine\W+converted_model.md$"):
        hub.write_model_card(tmp_path / "out", "converted-model", "org/base", template_dir=tmp_path / "mine")
    assert not (tmp_path / "out" / "README.md").exists()


def test_a_card_written_with_the_directory_s_own_name_as_placeholder_is_published_naming_the_repository(tmp_path):
    """Cards of earlier hf-accel versions put the directory's name in the placeholder as it was
    (`<your-namespace>/my index (v2)`); re-published, the placeholder was replaced up to its first space, leaving
    `custom_generate="me/my-index index (v2)"` in the snippets."""
    artifact = save_artifact(tmp_path / "my index (v2)", "drafter-index", "org/base", drafter="ngram")
    card = artifact / "README.md"
    card.write_text(card.read_text().replace("<your-namespace>/my-index-v2", "<your-namespace>/my index (v2)"))
    assert 'custom_generate="<your-namespace>/my index (v2)"' in card.read_text()  # the earlier versions' card
    snapshot = populate_hub_cache(artifact, "me/my-index", cache_dir=tmp_path / "hub")
    published = (snapshot / "README.md").read_text()
    assert 'custom_generate="me/my-index",' in published and "hf download me/my-index --local-dir" in published
    assert "<your-namespace>" not in published and "index (v2)" not in published.split("# my index (v2)")[1]


def test_repo_generate_on_an_older_hf_accel_is_one_line_asking_for_a_newer_one(monkeypatch):
    """`custom_generate/requirements.txt` asks for `hf-accel>=` the version that wrote the file, which the releases
    share: a repository published now, run where an earlier hf-accel is installed, stopped at an import inside
    generate.py (`cannot import name 'TokenizerMismatchError'`), saying nothing of what to do."""
    from hf_accel.speculative import repo_generate
    from hf_accel.speculative.drafters import index

    monkeypatch.delattr(index, "TokenizerMismatchError")  # as in the hf-accel of the first drafter repositories
    with pytest.raises(ImportError, match=r"needs a newer hf-accel .*: run `pip install -U hf-accel`$") as err:
        repo_generate.generate(object(), drafter="a drafter")
    assert len(str(err.value).splitlines()) == 1

    def missing_dependency(name):  # hf-accel's own import of a dependency that is not installed: that error, unchanged
        raise ModuleNotFoundError("No module named 'pydivsufsort'", name="pydivsufsort")

    monkeypatch.setattr(index, "__getattr__", missing_dependency, raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'pydivsufsort'$"):
        repo_generate.generate(object(), drafter="a drafter")


def test_a_drafter_folder_moved_elsewhere_is_one_line_saying_how_to_point_it_at_its_new_place(tmp_path):
    """A drafter's generate.py names the folder it was saved in (transformers runs a copy of it from its modules
    cache, which knows no folder): moved (to another machine, another path), it failed with "not an Infinigram index
    (no header.json): <the old path>", a path the call never named."""
    from hf_accel.hub import write_custom_generate

    model, tokenizer, _, artifact = _tiny_index_artifact(tmp_path)
    moved = Path(shutil.move(artifact, tmp_path / "moved"))
    inputs = tokenizer(["abcabcab"], return_tensors="pt")
    kwargs = {"do_sample": False, "max_new_tokens": 8, "custom_generate": str(moved), "trust_remote_code": True}
    with pytest.raises(FileNotFoundError, match=r"saved in, .*idx, which is not there \(moved\?\)") as err:
        model.generate(**inputs, **kwargs)
    assert len(str(err.value).splitlines()) == 1
    write_custom_generate(moved, "ngram", moved)  # as the message says
    assert torch.equal(model.generate(**inputs, **kwargs), model.generate(**inputs, do_sample=False, max_new_tokens=8))


def test_publishing_a_drafter_s_generate_py_of_an_earlier_version_warns_that_it_is_not_the_current_one(tmp_path):
    """A folder saved by an earlier hf-accel keeps that version's decoding code (one read the model repository's
    tokenizer with trust_remote_code=True), and a push republished it with only its ARTIFACT line changed, silently."""
    from transformers.testing_utils import CaptureLogger

    from hf_accel import hub
    from hf_accel.log import get_logger

    hub.write_custom_generate(tmp_path, "ngram", tmp_path)
    path = tmp_path / "custom_generate" / "generate.py"
    with CaptureLogger(get_logger(hub.__name__)) as logged:
        current = hub._published_bytes(path, tmp_path, "me/idx")
    assert logged.out == "" and b"ARTIFACT = 'me/idx'" in current
    path.write_text(path.read_text().replace("def ", "def  ", 1))  # an earlier version's file
    with CaptureLogger(get_logger(hub.__name__)) as logged:
        earlier = hub._published_bytes(path, tmp_path, "me/idx")
    assert earlier == current.replace(b"def ", b"def  ", 1)  # published as it is, pointing at the repository
    assert "is not the one this hf-accel writes" in logged.out and len(logged.out.strip().splitlines()) == 1


def test_a_drafter_folder_named_relatively_is_written_absolutely(tmp_path, monkeypatch):
    """`write_custom_generate(FOLDER, "ngram", FOLDER)` with a relative FOLDER wrote the relative path, which only
    worked from the directory it was written in."""
    from hf_accel.hub import write_custom_generate

    (tmp_path / "idx").mkdir()
    monkeypatch.chdir(tmp_path)
    write_custom_generate("idx", "ngram", "idx")
    assert f"ARTIFACT = {str(tmp_path / 'idx')!r}" in (tmp_path / "idx/custom_generate/generate.py").read_text()
    write_custom_generate("idx", "ngram", "org/idx")  # a repository id stays as it is
    assert "ARTIFACT = 'org/idx'" in (tmp_path / "idx/custom_generate/generate.py").read_text()
