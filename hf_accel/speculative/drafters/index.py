"""The on-disk Infinigram index: a suffix array over 32-bit token ids, memory-mapped for queries.

Layout of an index directory (format version 1):

- `header.json`: `{"format_version", "tokenizer_name", "vocab_hash", "vocab_size", "num_tokens", "num_documents",
  "sa_dtype", "sources"}`;
- `tokens.u32`: the token stream, little-endian `uint32`, documents separated by `SEPARATOR` (`0xFFFFFFFF`, never
  a token id, so vocabularies beyond 65,535 work);
- `sa.bin`: the suffix array of the **reversed** stream (`int32` below 2^31 tokens, `int64` above), built with
  libdivsufsort (pydivsufsort) on the big-endian bytes of the ids;
- `first.npy`: `int64[vocab_size + 1]`, start of each first token's range in the suffix array.

Why reversed: drafting needs the longest *suffix* of the context that occurs in the corpus. In the suffix array of
the reversed stream that suffix is a *prefix* of the reversed context, so the match grows one token at a time by
narrowing the current range (one `searchsorted` per token) instead of a binary search over match lengths, each
probe a full string comparison. An occurrence at reversed position `r` ends at stream index `N - 1 - r`, and its
continuation is `tokens[N - r : N - r + depth]`.
"""

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


INDEX_FORMAT_VERSION = 1
SEPARATOR = np.uint32(0xFFFFFFFF)
# Ranges narrower than this are narrowed with one vectorised read; wider ones with a scalar binary search.
_DENSE_RANGE = 4096


@dataclass
class IndexHeader:
    tokenizer_name: str
    vocab_hash: str
    vocab_size: int
    num_tokens: int = 0
    num_documents: int = 0
    sa_dtype: str = "int32"
    sources: list = field(default_factory=list)
    format_version: int = INDEX_FORMAT_VERSION


def tokenizer_fingerprint(tokenizer) -> tuple[str, str, int]:
    """`(name, vocab_hash, vocab_size)` of a tokenizer; the hash covers every `(token, id)` pair."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return str(getattr(tokenizer, "name_or_path", "") or ""), digest.hexdigest()[:16], max(vocab.values()) + 1


def build_index(
    documents: Iterable[Sequence[int]],
    out_dir: str | Path,
    tokenizer_name: str,
    vocab_hash: str,
    vocab_size: int,
    sources: list | None = None,
) -> IndexHeader:
    """Writes an index over token-id documents.

    Args:
        documents (`Iterable[Sequence[int]]`): token ids per document (responses, files, ...).
        out_dir (`str` or `Path`): directory to create (files are replaced).
        tokenizer_name (`str`), vocab_hash (`str`), vocab_size (`int`): from [`tokenizer_fingerprint`].
        sources (`list`, *optional*): free-form provenance written to the header.

    Returns:
        [`IndexHeader`]
    """
    from pydivsufsort import divsufsort  # avoid importing the C library unless an index is built

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chunks, num_documents = [], 0
    for doc in documents:
        array = np.asarray(doc, dtype=np.int64)
        if len(array) == 0:
            continue
        if array.min() < 0 or array.max() >= vocab_size:
            raise ValueError(f"document {num_documents} has token ids outside [0, {vocab_size})")
        chunks.append(array.astype(np.uint32))
        chunks.append(np.array([SEPARATOR], dtype=np.uint32))
        num_documents += 1
    if not chunks:
        raise ValueError("no tokens to index: every document was empty")
    tokens = np.concatenate(chunks)
    del chunks
    tokens.astype("<u4").tofile(out / "tokens.u32")
    suffix_array = divsufsort(np.ascontiguousarray(tokens[::-1]))
    sa_dtype = "int32" if len(tokens) < 2**31 else "int64"
    suffix_array.astype(sa_dtype).tofile(out / "sa.bin")
    del suffix_array
    counts = np.bincount(tokens[tokens != SEPARATOR].astype(np.int64), minlength=vocab_size)
    np.save(out / "first.npy", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
    header = IndexHeader(tokenizer_name, vocab_hash, int(vocab_size), len(tokens), num_documents, sa_dtype, sources or [])
    (out / "header.json").write_text(json.dumps(asdict(header), indent=1))
    return header


class InfinigramIndex:
    """Read-only, memory-mapped view of an index directory.

    Args:
        path (`str` or `Path`): the index directory.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header_file = self.path / "header.json"
        if not header_file.is_file():
            raise FileNotFoundError(f"not an Infinigram index (no header.json): {self.path}")
        raw = json.loads(header_file.read_text())
        if raw.get("format_version") != INDEX_FORMAT_VERSION:
            raise ValueError(
                f"index {self.path} has format version {raw.get('format_version')}, this hf-accel reads version "
                f"{INDEX_FORMAT_VERSION}; rebuild it with `hf-accel index build`"
            )
        self.header = IndexHeader(**raw)
        self.tokens = np.memmap(self.path / "tokens.u32", dtype="<u4", mode="r")
        self.suffix_array = np.memmap(self.path / "sa.bin", dtype=self.header.sa_dtype, mode="r")
        self.first = np.load(self.path / "first.npy")
        self.num_tokens = len(self.tokens)

    def check_tokenizer(self, tokenizer) -> None:
        """Raises `ValueError` if the index was built with a different tokenizer than `tokenizer`."""
        name, vocab_hash, vocab_size = tokenizer_fingerprint(tokenizer)
        if vocab_hash != self.header.vocab_hash:
            raise ValueError(
                f"index {self.path} was built with tokenizer {self.header.tokenizer_name!r} (vocabulary hash "
                f"{self.header.vocab_hash}, {self.header.vocab_size} ids) but the model's tokenizer {name!r} has "
                f"vocabulary hash {vocab_hash} ({vocab_size} ids); token ids would not mean the same thing. Rebuild "
                "the index with this model: `hf-accel index build --model <model> --out DIR ...`"
            )

    # --------------------------------------------------------------------------------------------------- queries
    def _reversed_token(self, sa_positions: np.ndarray, offset: int) -> np.ndarray:
        """Token at `offset` of each reversed suffix (-1 past the start of the stream, which sorts first)."""
        index = self.num_tokens - 1 - sa_positions.astype(np.int64) - offset
        values = self.tokens[np.clip(index, 0, None)].astype(np.int64)
        return np.where(index >= 0, values, -1)

    def _narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """Sub-range of `[lo, hi)` whose reversed suffixes have `token` at `offset` (all share `offset` tokens)."""
        if hi - lo <= _DENSE_RANGE:
            values = self._reversed_token(np.asarray(self.suffix_array[lo:hi]), offset)
            return lo + int(np.searchsorted(values, token, "left")), lo + int(np.searchsorted(values, token, "right"))

        def bound(strict: bool) -> int:
            a, b = lo, hi
            while a < b:
                mid = (a + b) // 2
                value = int(self._reversed_token(np.asarray(self.suffix_array[mid : mid + 1]), offset)[0])
                if value < token or (strict and value == token):
                    a = mid + 1
                else:
                    b = mid
            return a

        return bound(False), bound(True)

    def longest_suffix(self, context: Sequence[int], max_match: int = 64) -> tuple[int, int, int]:
        """Longest suffix of `context` occurring in the index: `(match_length, lo, hi)`, its suffix-array range.

        `match_length == 0` means not even the last token occurs (`lo == hi == 0`).
        """
        context = np.asarray(context, dtype=np.int64)
        if len(context) == 0 or not 0 <= context[-1] < len(self.first) - 1:
            return 0, 0, 0
        last = int(context[-1])
        lo, hi = int(self.first[last]), int(self.first[last + 1])
        if lo == hi:
            return 0, 0, 0
        length = 1
        while length < min(max_match, len(context)):
            new_lo, new_hi = self._narrow(lo, hi, length, int(context[-1 - length]))
            if new_lo >= new_hi:
                break
            lo, hi, length = new_lo, new_hi, length + 1
        return length, lo, hi

    def continuations(self, lo: int, hi: int, match_length: int, depth: int, max_support: int = 1000) -> np.ndarray:
        """Continuations of the occurrences in `[lo, hi)`: `int64[count, depth]`, `-1` after a document end.

        More than `max_support` occurrences are subsampled with a uniform deterministic stride (B.11 item 9: the
        public engine strides too; the thesis says "uniformly").
        """
        count = hi - lo
        stride = max(1, -(-count // max_support))
        positions = np.asarray(self.suffix_array[lo:hi:stride][:max_support]).astype(np.int64)
        starts = self.num_tokens - positions  # first continuation token (stream index)
        index = starts[:, None] + np.arange(depth)[None, :]
        values = self.tokens[np.clip(index, 0, self.num_tokens - 1)].astype(np.int64)
        values[index >= self.num_tokens] = -1
        ended = np.cumsum(values == SEPARATOR, axis=1) > 0  # a separator ends the document
        values[ended] = -1
        return values
