import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_accel.cli import main
from hf_accel.hub import ARTIFACT_KINDS, HubError, populate_hub_cache, push_to_hub, save_artifact, write_model_card
from tests.tiny_checkpoints import logits_in_fresh_process, sample_logits, write_tiny_remote_model


REPO_ROOT = Path(__file__).resolve().parents[1]
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
