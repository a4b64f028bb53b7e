"""Training text: loading (a `datasets` dataset or local text files), tokenization, packing into fixed-length blocks.

Packing convention: documents are tokenized without special tokens, each is followed by the EOS token (when the
tokenizer has one), the token stream is concatenated and cut into consecutive blocks of `seq_len` tokens; the tail
shorter than a block is dropped. Every block is a full training example: no padding, so every position but the
last predicts a real next token. Packing runs per `datasets.map` batch of documents, so at most one partial block per
map batch is lost.
"""

import codecs
from pathlib import Path

import torch


def pack_token_ids(sequences: list[list[int]], seq_len: int, separator_id: int | None = None) -> list[list[int]]:
    """Concatenates token sequences (each followed by `separator_id`) and cuts the stream into `seq_len` blocks.

    Args:
        sequences (`list[list[int]]`): tokenized documents.
        seq_len (`int`): block length.
        separator_id (`int`, *optional*): a token appended after every document (EOS); none if `None`.

    Returns:
        `list[list[int]]`: full blocks only; the remaining tail is dropped.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    stream = []
    for ids in sequences:
        stream.extend(ids)
        if separator_id is not None:
            stream.append(separator_id)
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def check_utf8_file(path: str, chunk_bytes: int = 1 << 20, what: str = "training text file") -> None:
    """Raises a one-line `ValueError` naming `path` and its first byte that is not UTF-8 (`datasets` raises a long
    `DatasetGenerationError` that names no file, Python's decoder names neither file nor offset in it).

    Args:
        path (`str`): a text file.
        chunk_bytes (`int`, *optional*, defaults to 1 MiB): the file is read in chunks of this many bytes.
        what (`str`, *optional*, defaults to `"training text file"`): what the file is, for the message.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes handed to the decoder before this chunk
    with open(path, "rb") as f:
        try:
            while chunk := f.read(chunk_bytes):
                pending = len(decoder.getstate()[0])  # the start of a character cut by the previous chunk
                decoder.decode(chunk)
                offset += len(chunk)
            pending = len(decoder.getstate()[0])
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            start = offset - pending + err.start
            raise ValueError(f"{what} {path} is not UTF-8 text: byte {start} ({err.reason})") from None


def read_text_file(path: str | Path, what: str = "text file") -> str:
    """The text of a UTF-8 file, a leading byte order mark (Windows editors write one) left out; a file that is not
    UTF-8 raises [`check_utf8_file`]'s one-line `ValueError` naming it (`what`) and its first bad byte."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        check_utf8_file(str(path), what=what)
        raise


def load_text_dataset(
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_files: list[str] | None = None,
):
    """Loads training text as a `datasets.Dataset` with a `text` column (for files) or the dataset's own columns.

    Args:
        dataset_name (`str`, *optional*): a Hub dataset id (needs network or a populated cache), a local data
            directory, or a directory written by `save_to_disk`.
        dataset_config (`str`, *optional*): the dataset's configuration name (e.g. `wikitext-103-raw-v1`).
        split (`str`, *optional*, defaults to `"train"`): the split to use.
        text_files (`list[str]`, *optional*): plain UTF-8 text files; each file is one document.

    Returns:
        `datasets.Dataset`.
    """
    import datasets

    if (dataset_name is None) == (not text_files):
        raise ValueError("give exactly one of a dataset (--dataset_name) or text files (--train_files)")
    if text_files:
        missing = [f for f in text_files if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"training text file(s) not found: {', '.join(missing)}")
        for path in text_files:
            check_utf8_file(path)
        # utf-8-sig: a byte order mark (Windows editors write one) is no text
        return datasets.load_dataset(
            "text", data_files=list(text_files), sample_by="document", encoding="utf-8-sig", split="train"
        )
    from ..loading import load_dataset_split

    return load_dataset_split(dataset_name, split, dataset_config)


def tokenize_and_pack(dataset, tokenizer, seq_len: int, text_column: str = "text", max_blocks: int | None = None):
    """Tokenizes a text dataset and packs it into blocks of `seq_len` tokens (see the module docstring).

    Args:
        dataset (`datasets.Dataset`): rows with a text column.
        tokenizer (`PreTrainedTokenizerBase`): the student's (and teacher's) tokenizer.
        seq_len (`int`): block length in tokens.
        text_column (`str`, *optional*, defaults to `"text"`): the column holding the text.
        max_blocks (`int`, *optional*): keep only the first `max_blocks` blocks.

    Returns:
        `datasets.Dataset` with one column, `input_ids` (each a list of `seq_len` ints).
    """
    if text_column not in dataset.column_names:
        raise ValueError(f"the dataset has no column {text_column!r}; columns: {dataset.column_names}")
    feature = dataset.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"the dataset's column {text_column!r} holds values that are not text ({feature})")
    separator = tokenizer.eos_token_id

    def _pack(batch):
        texts = [t for t in batch[text_column] if t]
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
        return {"input_ids": pack_token_ids(ids, seq_len, separator)}

    packed = dataset.map(_pack, batched=True, remove_columns=dataset.column_names, desc="tokenize and pack")
    if len(packed) == 0:
        raise ValueError(f"the training text is shorter than one block of {seq_len} tokens")
    if max_blocks is not None and max_blocks < len(packed):
        packed = packed.select(range(max_blocks))
    return packed


class PackedBlockCollator:
    """Stacks packed blocks into a batch; `labels` are the `input_ids` (the loss shifts them), nothing is masked.

    Example:
        ```python
        >>> PackedBlockCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10]}])["labels"].shape
        torch.Size([2, 3])

        ```
    """

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = {len(f["input_ids"]) for f in features}
        if len(lengths) != 1:
            raise ValueError(f"packed blocks must have one length, got lengths {sorted(lengths)}")
        input_ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)  # [B, S]
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
