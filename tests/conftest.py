import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


# Nothing may come from the network in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run in its CPU interpreter unless the caller says otherwise (TRITON_INTERPRET=0 on a GPU machine).
# It must be set before anything imports triton, and transformers may import it on the way.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Nothing is cached in the user's folders, and two runs at once share no cache: transformers caches a checkpoint's
# remote code under the checkpoint directory's name, which pytest's `tmp_path` names repeat from run to run.
_CACHES = tempfile.mkdtemp(prefix="hf-accel-tests-")
atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)
os.environ["HF_MODULES_CACHE"] = os.path.join(_CACHES, "modules")
os.environ["HF_DATASETS_CACHE"] = os.path.join(_CACHES, "datasets")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# The shared tiny GQA configuration (4 query heads, 2 KV heads); tests of other families override a few keys.
TINY_CONFIG = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def _transformers_adapter_refusal() -> str | None:
    """transformers' own PEFT integration (`add_adapter`, `load_adapter`, `from_pretrained` of an adapter folder)
    refuses a PEFT older than it was written for (5.24 asks for PEFT 0.22, not yet released): its message, or None."""
    from transformers.integrations.peft import MIN_PEFT_VERSION
    from transformers.utils.peft_utils import check_peft_version

    try:
        check_peft_version(MIN_PEFT_VERSION)
    except ValueError as refusal:
        return str(refusal)
    return None


requires_transformers_adapters = pytest.mark.skipif(
    _transformers_adapter_refusal() is not None,
    reason=f"transformers' add_adapter refuses the installed PEFT: {_transformers_adapter_refusal()}",
)


def make_tiny_llama(seed: int = 0, **overrides):
    """A random-initialised Llama small enough for exhaustive tests (GQA: 4 query heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = {**TINY_CONFIG, **overrides}
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kwargs)).eval()


class LargestStorage(TorchDispatchMode):
    """Records the largest storage (bytes) of any tensor an aten op returns inside it: what a step allocates at once
    (views share their base's storage), checked without timings."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.untyped_storage().nbytes())
        return out


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(params=["batched", "grouped"])
def prefill(request, monkeypatch):
    """Both prefills of the speculative engine: one batched pass, and a ragged batch's rows in groups
    (`hf_accel.speculative.prefill`; with no pass overhead, every prompt length gets its own group)."""
    from hf_accel.speculative import prefill as module

    monkeypatch.setattr(module, "PASS_OVERHEAD_TOKENS", {"cpu": 0} if request.param == "grouped" else {})
    return request.param


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct, loaded once for every test that needs the real model."""
    from hf_accel.loading import load_model_and_tokenizer

    return load_model_and_tokenizer("smollm2-135m")


SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="session")
def shakespeare_text():
    """Real English text: ../shared/data/tinyshakespeare.txt beside the checkout (CI has it there)."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} is not there")
    return SHAKESPEARE.read_text(encoding="utf-8")
