"""Tiny checkpoints written to disk for training and Hub tests: a character-level tokenizer, a plain Llama, and a
trust_remote_code model whose attention has low-rank key/value projections with made-up names (`k_proj.down`,
`k_proj.up`, ...), standing in for a converted (CARE/Palu) checkpoint.
"""

import string
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.conftest import TINY_CONFIG


VOCAB_SIZE = 128

CONFIG_PY = """
from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class TinyLatentConfig(LlamaConfig):
    model_type = "tiny_latent"
    kv_rank: int = 4
"""

MODELING_PY = """
from collections import OrderedDict

from torch import nn
from transformers import LlamaForCausalLM

from .configuration_tiny_latent import TinyLatentConfig


def _low_rank(d_in, rank, d_out):
    return nn.Sequential(OrderedDict(down=nn.Linear(d_in, rank, bias=False), up=nn.Linear(rank, d_out, bias=False)))


class TinyLatentForCausalLM(LlamaForCausalLM):
    config_class = TinyLatentConfig

    def __init__(self, config):
        super().__init__(config)
        kv_out = config.num_key_value_heads * config.head_dim
        for layer in self.model.layers:
            layer.self_attn.k_proj = _low_rank(config.hidden_size, config.kv_rank, kv_out)
            layer.self_attn.v_proj = _low_rank(config.hidden_size, config.kv_rank, kv_out)
        self.post_init()
"""

AUTO_MAP = {
    "AutoConfig": "configuration_tiny_latent.TinyLatentConfig",
    "AutoModelForCausalLM": "modeling_tiny_latent.TinyLatentForCausalLM",
}

TINY = {**TINY_CONFIG, "vocab_size": VOCAB_SIZE}


def make_char_tokenizer():
    """A character-level fast tokenizer: BPE without merges over printable ASCII, ids below VOCAB_SIZE."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(string.printable)))}
    assert len(vocab) <= VOCAB_SIZE
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A plain random Llama with the character tokenizer (the teacher in healing tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return Path(path)


def write_tiny_remote_model(path: Path, seed: int = 0) -> Path:
    """A random trust_remote_code checkpoint (`model_type` `tiny_latent`) with its code files and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "configuration_tiny_latent.py").write_text(CONFIG_PY)
    (path / "modeling_tiny_latent.py").write_text(MODELING_PY)
    # config.json first, so AutoConfig can find the class through auto_map.
    import json

    (path / "config.json").write_text(json.dumps({"model_type": "tiny_latent", "auto_map": AUTO_MAP, **TINY}))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path


def sample_logits(model, seed: int = 0) -> torch.Tensor:
    """Logits of a fixed random batch (2 x 12 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, VOCAB_SIZE, (2, 12), generator=generator)
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


RELOAD_SCRIPT = """
import sys, torch
sys.modules["hf_accel"] = None  # a saved checkpoint must load without hf_accel (installed or not)
from transformers import AutoModelForCausalLM
sys.path.insert(0, {tests_parent!r})
from tests.tiny_checkpoints import sample_logits
model = AutoModelForCausalLM.from_pretrained({name!r}, trust_remote_code=True)
torch.save(sample_logits(model), {out!r})
print(type(model).__name__)
"""


def logits_in_fresh_process(name: str, out: Path, env: dict) -> tuple[torch.Tensor, str]:
    """Loads `name` with `AutoModelForCausalLM.from_pretrained(name, trust_remote_code=True)` in a new Python process
    (with the environment `env`) and returns its [`sample_logits`] and the loaded class name."""
    script = RELOAD_SCRIPT.format(tests_parent=str(Path(__file__).resolve().parents[1]), name=str(name), out=str(out))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out), proc.stdout.strip().splitlines()[-1]
