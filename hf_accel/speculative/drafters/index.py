"""The on-disk Infinigram index: a suffix array over 32-bit token ids, memory-mapped for queries.

Layout of an index directory (format version 1):

- `header.json`: `{"format_version", "tokenizer_name", "vocab_hash", "vocab_size", "num_tokens", "num_documents",
  "sa_dtype", "sources"}` (`num_tokens` is the stream's length, separators included);
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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from ...log import progress_bar


INDEX_FORMAT_VERSION = 1
SEPARATOR = np.uint32(0xFFFFFFFF)
INDEX_FILES = ("header.json", "tokens.u32", "sa.bin", "first.npy")
# The indexes shipped in the package (self-distilled from the default model), loaded by folder name
SHIPPED_INDEXES_DIR = Path(__file__).resolve().parents[2] / "data" / "indexes"
# A header is a few hundred bytes (its `sources` list grows by one short line per input); a larger file, as an
# untrusted index directory may hold, is refused before it is read whole
MAX_HEADER_BYTES = 1 << 24
# Ranges narrower than this are narrowed with one vectorised read; wider ones with a scalar binary search.
_DENSE_RANGE = 2048
# Ranges this small are finished with one read of every candidate's whole common prefix.
_FEW = 32


class TokenizerMismatchError(ValueError):
    """An index built with another tokenizer than the one it is checked against ([`InfinigramIndex.check_tokenizer`])."""


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

    @property
    def num_indexed_tokens(self) -> int:
        """Tokens of the documents: `num_tokens` is the stream's length, one separator per document included."""
        return self.num_tokens - self.num_documents


def tokenizer_fingerprint(tokenizer, below: int | None = None) -> tuple[str, str, int]:
    """`(name, vocab_hash, vocab_size)` of a tokenizer: `vocab_size` is its largest id + 1, and the hash covers every
    `(token, id)` pair with an id below `below` (defaults to `vocab_size`: all of them).

    An index holds ids below its header's `vocab_size` only, so [`InfinigramIndex.check_tokenizer`] hashes the
    tokenizer's pairs below that bound: tokens added after the build (a pad token) do not change what the index's ids
    mean, a token changed or removed below the bound does."""
    vocab = tokenizer.get_vocab()
    vocab_size = max(vocab.values()) + 1
    below = vocab_size if below is None else below
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        if index < below:
            digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return str(getattr(tokenizer, "name_or_path", "") or ""), digest.hexdigest()[:16], vocab_size


def build_index(
    documents: Iterable[Sequence[int]],
    out_dir: str | Path,
    tokenizer_name: str,
    vocab_hash: str,
    vocab_size: int,
    sources: list | None = None,
    progress: bool = True,
) -> IndexHeader:
    """Writes an index over token-id documents.

    The documents are consumed once, as they come: each one's ids go straight to the staged `tokens.u32`, so a
    generator of documents is never held whole; the suffix array is then built from that file. A progress bar counts
    the documents (a generator that tokenizes a dataset as it goes makes that the long part).

    Args:
        documents (`Iterable[Sequence[int]]`): token ids per document (responses, files, ...).
        out_dir (`str` or `Path`): directory to create (files are replaced).
        tokenizer_name (`str`), vocab_hash (`str`), vocab_size (`int`): from [`tokenizer_fingerprint`].
        sources (`list`, *optional*): free-form provenance written to the header.
        progress (`bool`, *optional*, defaults to `True`): show the documents' progress bar.

    Returns:
        [`IndexHeader`]
    """
    from ...atomic import staged_files

    # checked before any work: a header over the cap would be written, then refused by every load
    provenance = len(json.dumps(sources or [], indent=1).encode())
    if provenance > MAX_HEADER_BYTES - 4096:  # the other fields take a few hundred bytes
        raise ValueError(
            f"the index's `sources` take {provenance:,} bytes of JSON; a header holds at most {MAX_HEADER_BYTES:,}: "
            "list fewer, shorter sources (e.g. the folder instead of each file)"
        )
    # the old header goes first and the new one last: an interrupted rebuild (or a bad document found half way)
    # does not load, rather than pairing new tokens with an old suffix array
    with staged_files(out_dir, last=("header.json",)) as tmp:
        with progress_bar(documents, progress, desc="indexing", unit="doc") as counted:  # closed on a bad document
            num_tokens, num_documents = write_token_stream(counted, tmp / "tokens.u32", vocab_size)
        sa_dtype = "int32" if num_tokens < 2**31 else "int64"
        header = IndexHeader(
            tokenizer_name, vocab_hash, int(vocab_size), num_tokens, num_documents, sa_dtype, sources or []
        )
        tokens = np.memmap(tmp / "tokens.u32", dtype="<u4", mode="r")
        suffix_array = reversed_suffix_array(tokens)
        suffix_array.astype(sa_dtype, copy=False).tofile(tmp / "sa.bin")
        del suffix_array
        np.save(tmp / "first.npy", first_token_starts(tokens, vocab_size))
        del tokens  # unmapped before the staged files move
        (tmp / "header.json").write_text(json.dumps(asdict(header), indent=1))
    return header


def write_token_stream(documents: Iterable[Sequence[int]], path: Path, vocab_size: int) -> tuple[int, int]:
    """Appends each non-empty document's ids to `path` (little-endian `uint32`), each followed by `SEPARATOR`, one
    document at a time; returns `(stream length, number of documents)`. `ValueError` names a document whose ids are
    not a flat sequence in `[0, vocab_size)`, and an input with no tokens at all."""
    num_tokens, num_documents = 0, 0
    separator = np.array([SEPARATOR], dtype="<u4").tobytes()
    with open(path, "wb") as stream:
        for number, doc in enumerate(documents):
            try:
                array = np.asarray(doc.cpu() if hasattr(doc, "cpu") else doc)  # a torch tensor on any device
            except ValueError:  # ragged nesting: numpy's message names no document
                raise ValueError(f"document {number} is not a flat sequence of token ids (ragged)") from None
            if array.size == 0:
                continue
            if array.ndim != 1:
                raise ValueError(f"document {number} is not a flat sequence of token ids (shape {array.shape})")
            if array.dtype.kind not in "iu":  # floats would be truncated to other ids, bools read as 0 and 1
                raise ValueError(f"document {number} holds {array.dtype} values, not integer token ids")
            if array.min() < 0 or array.max() >= vocab_size:
                raise ValueError(f"document {number} has token ids outside [0, {vocab_size})")
            stream.write(array.astype("<u4").tobytes())
            stream.write(separator)
            num_tokens += len(array) + 1
            num_documents += 1
    if not num_documents:
        raise ValueError("no tokens to index: every document was empty")
    return num_tokens, num_documents


def reversed_suffix_array(tokens: np.ndarray, chunk: int = 1 << 22) -> np.ndarray:
    """Suffix array of `tokens` reversed: libdivsufsort (through pydivsufsort) sorts the big-endian bytes of the ids,
    whose order is the ids' order, and the suffixes that start at a token boundary are kept, `chunk` at a time.

    Memory: 4 bytes a token for the bytes, 16 for the byte-level array (32 from 2^29 tokens on, where it needs int64),
    then 4 (8 from 2^31 tokens on) for the token-level one: 20 bytes a token at the peak. pydivsufsort's own handling
    of `uint32` input takes 44 (an offset copy of the ids, and a whole `array % 4` beside the array).
    """
    from pydivsufsort import divsufsort  # avoid importing the C library unless an index is built

    data = np.ascontiguousarray(tokens[::-1], dtype=">u4").view(np.uint8)
    byte_array = divsufsort(data)
    del data
    suffix_array = np.empty(len(tokens), dtype=np.int32 if len(tokens) < 2**31 else np.int64)
    filled = 0
    for start in range(0, len(byte_array), chunk):
        part = byte_array[start : start + chunk]
        part = part[part % 4 == 0] // 4
        suffix_array[filled : filled + len(part)] = part
        filled += len(part)
    return suffix_array


def first_token_starts(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """`int64[vocab_size + 1]`: where each first token's range starts in the suffix array (counts of each id,
    separators left out, accumulated), counted `chunk` tokens at a time."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk])
        counts += np.bincount(part[part != SEPARATOR], minlength=vocab_size)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def resolve_index_dir(name_or_path: str | Path) -> Path:
    """A local index directory as is; the name of an index shipped with hf-accel (`smollm2-135m-chat-build`, a folder
    of [`SHIPPED_INDEXES_DIR`]: found in a checkout and in an installed wheel alike) when no local path has that name;
    otherwise `name_or_path` is taken as a Hub repo id and its snapshot (index files only) is fetched or found in the
    Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from ...loading import hub_unreachable, looks_like_local_path

    path = Path(name_or_path).expanduser()
    shipped = SHIPPED_INDEXES_DIR / str(name_or_path)
    if "/" not in str(name_or_path) and not path.exists() and (shipped / "header.json").is_file():
        return shipped
    if looks_like_local_path(str(name_or_path)) or str(name_or_path).count("/") != 1:
        return path

    try:
        return Path(  # without network, straight to the cache (else ~25 s of retries)
            snapshot_download(str(name_or_path), allow_patterns=list(INDEX_FILES), local_files_only=hub_unreachable())
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise FileNotFoundError(
            f"no index directory {name_or_path!r}, and no Hub repository of that id could be read "
            f"({type(err).__name__}); pass an index directory or a pushed index's repo id"
        ) from None


def links_outside(path: Path) -> dict[str, Path]:
    """The index files of `path` that resolve outside it (links someone else's folder may hold, to any file on this
    machine), with where they point. Links of a Hugging Face cache snapshot into its repository's `blobs/` folder,
    which is how the Hub client stores every download, are inside."""
    root = path.resolve()
    inside = [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]
    targets = {name: (path / name).resolve() for name in INDEX_FILES if (path / name).is_symlink()}
    return {name: target for name, target in targets.items() if not any(target.is_relative_to(d) for d in inside)}


class InfinigramIndex:
    """Read-only, memory-mapped view of an index directory.

    Args:
        path (`str` or `Path`): the index directory, the name of a shipped one (`smollm2-135m-chat-build`), or the
            id of a Hub repository holding one (a pushed `drafter-index` artifact: downloaded once into the Hugging
            Face cache, read from it with `HF_HUB_OFFLINE=1`).
    """

    def __init__(self, path: str | Path):
        self.path = resolve_index_dir(path)
        header_file = self.path / "header.json"
        if not header_file.is_file():
            raise FileNotFoundError(f"not an Infinigram index (no header.json): {self.path}")
        rebuild = "; rebuild it with `hf-accel index build`"
        for name, target in links_outside(self.path).items():
            raise ValueError(f"index {self.path}: {name} links outside the index directory, to {target}; not read")
        with open(header_file, "rb") as f:
            data = f.read(MAX_HEADER_BYTES + 1)  # read to the cap only: the file may grow, or be a sparse giant
        if len(data) > MAX_HEADER_BYTES:
            raise ValueError(
                f"index {self.path}: header.json is larger than an index header's {MAX_HEADER_BYTES:,} bytes; not read"
            )
        try:
            raw = json.loads(data.decode("utf-8"))
            version = raw.get("format_version") if isinstance(raw, dict) else None
        except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, arrays nested too deep
            raise ValueError(f"index {self.path}: header.json is not valid JSON ({err}){rebuild}") from None
        if version != INDEX_FORMAT_VERSION:
            raise ValueError(
                f"index {self.path} has format version {version}, this hf-accel reads version "
                f"{INDEX_FORMAT_VERSION}; rebuild it with `hf-accel index build`"
            )
        known = {f.name for f in fields(IndexHeader)}
        try:
            self.header = IndexHeader(**{k: v for k, v in raw.items() if k in known})
            counts = [getattr(self.header, k) for k in ("num_tokens", "num_documents", "vocab_size")]
            # every index has a document and each document at least one token and its separator
            if (
                self.header.sa_dtype not in ("int32", "int64")
                or not all(type(n) is int for n in counts)
                or not (0 < self.header.num_documents < self.header.num_tokens and self.header.vocab_size > 0)
            ):
                raise TypeError("bad sa_dtype or counts")
        except TypeError as err:
            raise ValueError(f"index {self.path}: header.json is not a valid index header ({err}){rebuild}") from None
        header = self.header
        for name, itemsize in (("tokens.u32", 4), ("sa.bin", np.dtype(header.sa_dtype).itemsize)):
            path = self.path / name
            size = path.stat().st_size if path.is_file() else None
            if size != itemsize * header.num_tokens:  # checked before mapping: numpy's own errors name no file
                found = "it is missing" if size is None else f"it has {size:,} bytes"
                raise ValueError(
                    f"index {self.path}: {name} should hold {header.num_tokens:,} entries ({itemsize * header.num_tokens:,} "
                    f"bytes) but {found}{rebuild}"
                )
        try:  # mapped: a crafted header's shape is checked against the file's size, not allocated first
            self.first = np.load(self.path / "first.npy", mmap_mode="r")
        except (OSError, ValueError, EOFError) as err:  # EOFError: an empty file
            raise ValueError(f"index {self.path}: first.npy cannot be read ({err}){rebuild}") from None
        if not isinstance(self.first, np.ndarray):  # a zip (`.npz`) loads as a lazy archive of arrays
            self.first.close()
            raise ValueError(  # noqa: TRY004
                f"index {self.path}: first.npy cannot be read (an .npz archive, not one array){rebuild}"
            )
        if (
            self.first.dtype.kind not in "iu"
            or self.first.shape != (header.vocab_size + 1,)
            or (int(self.first[0]) != 0 or int(self.first[-1]) != header.num_indexed_tokens)
            # range starts past the suffix array (or before it) would fail mid-generation, not here
            or (np.diff(self.first.astype(np.int64)) < 0).any()
        ):
            raise ValueError(
                f"index {self.path}: first.npy ({self.first.dtype}, shape {self.first.shape}) does not match the header "
                f"(int64, shape ({header.vocab_size + 1},), non-decreasing from 0 to {header.num_indexed_tokens})"
                f"{rebuild}"
            )
        self.first = np.array(self.first)  # read once checked; no map left open on a file a rebuild replaces
        self.tokens = np.memmap(self.path / "tokens.u32", dtype="<u4", mode="r")
        self.suffix_array = np.memmap(self.path / "sa.bin", dtype=header.sa_dtype, mode="r")
        self.num_tokens = len(self.tokens)

    def check_tokenizer(self, tokenizer) -> None:
        """Raises [`TokenizerMismatchError`] (a `ValueError`) unless `tokenizer` maps the ids the index can hold
        (those below the header's `vocab_size`) as the build's tokenizer did: tokens added after them (a pad token)
        are fine."""
        bound = self.header.vocab_size
        name, vocab_hash, vocab_size = tokenizer_fingerprint(tokenizer, below=bound)
        if vocab_hash != self.header.vocab_hash:
            raise TokenizerMismatchError(
                f"index {self.path} was built with tokenizer {self.header.tokenizer_name!r} (vocabulary hash "
                f"{self.header.vocab_hash}, {bound} ids) but the model's tokenizer {name!r} has vocabulary hash "
                f"{vocab_hash} over its ids below {bound} ({vocab_size} ids in all); token ids would not mean the "
                "same thing. Rebuild the index with this model: `hf-accel index build --model <model> --out DIR ...`"
            )

    # --------------------------------------------------------------------------------------------------- queries
    def _reversed_token(self, sa_positions: np.ndarray, offset: int) -> np.ndarray:
        """Token at `offset` of each reversed suffix (-1 past the start of the stream, which sorts first)."""
        index = self.num_tokens - 1 - sa_positions.astype(np.int64) - offset
        return self._stream_tokens(index)

    def _stream_tokens(self, index: np.ndarray) -> np.ndarray:
        """`tokens[index]` as `int64`, -1 outside the stream: before its start, and wherever a corrupt `sa.bin` (only
        its size is checked at load) points, so that such an index drafts garbage, which the target rejects, rather
        than failing mid-generation."""
        inside = (index >= 0) & (index < self.num_tokens)
        return np.where(inside, self.tokens[np.clip(index, 0, self.num_tokens - 1)].astype(np.int64), -1)

    def _narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """Sub-range of a small `[lo, hi)` whose reversed suffixes have `token` at `offset` (one vectorised read)."""
        values = self._reversed_token(np.asarray(self.suffix_array[lo:hi]), offset)
        return lo + int(np.searchsorted(values, token, "left")), lo + int(np.searchsorted(values, token, "right"))

    def _compare(self, sa_index: int, pattern: np.ndarray) -> tuple[int, int]:
        """`(lcp, order)` of the reversed suffix at `sa_index` against `pattern`: their longest common prefix and
        -1 / 0 / +1 if the suffix sorts before / starts with / sorts after the pattern."""
        # reversed suffix = tokens[:start][::-1] (clipped: a corrupt entry must not wrap the slice around)
        start = min(max(self.num_tokens - int(self.suffix_array[sa_index]), 0), self.num_tokens)
        window = np.asarray(self.tokens[max(0, start - len(pattern)) : start][::-1]).astype(np.int64)
        differ = np.nonzero(window != pattern[: len(window)])[0]
        if len(differ):
            lcp = int(differ[0])
            return lcp, -1 if window[lcp] < pattern[lcp] else 1
        return len(window), 0 if len(window) == len(pattern) else -1  # a shorter suffix sorts first

    def _bound(self, lo: int, hi: int, pattern: np.ndarray, upper: bool) -> int:
        """First index in `[lo, hi)` whose suffix sorts after (`upper`) / not before the pattern as a prefix."""
        while lo < hi:
            mid = (lo + hi) // 2
            _, order = self._compare(mid, pattern)
            if order < 0 or (upper and order == 0):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def longest_suffix(self, context: Sequence[int], max_match: int = 64) -> tuple[int, int, int]:
        """Longest suffix of `context` occurring in the index: `(match_length, lo, hi)`, its suffix-array range.

        `match_length == 0` means not even the last token occurs (`lo == hi == 0`). Small ranges are narrowed one
        token at a time; in a wide range the reversed context is binary-searched whole, and the longest match is
        the longer common prefix with the suffixes on either side of its insertion point.
        """
        pattern = np.asarray(context, dtype=np.int64)[::-1][:max_match]
        if len(pattern) == 0 or not 0 <= pattern[0] < len(self.first) - 1:
            return 0, 0, 0
        lo, hi = int(self.first[pattern[0]]), int(self.first[pattern[0] + 1])
        if lo == hi:
            return 0, 0, 0
        length = 1
        if hi - lo > _DENSE_RANGE and len(pattern) > 1:
            insert = self._bound(lo, hi, pattern, upper=False)
            length = max(self._compare(i, pattern)[0] for i in (insert - 1, insert) if lo <= i < hi)
            prefix = pattern[:length]
            lo, hi = self._bound(lo, insert, prefix, upper=False), self._bound(insert, hi, prefix, upper=True)
        while length < len(pattern) and _FEW < hi - lo <= _DENSE_RANGE:
            new_lo, new_hi = self._narrow(lo, hi, length, int(pattern[length]))
            if new_lo >= new_hi:
                return length, lo, hi
            lo, hi, length = new_lo, new_hi, length + 1
        if length < len(pattern) and hi - lo <= _FEW:
            return self._finish_few(lo, hi, pattern)
        return length, lo, hi

    def _finish_few(self, lo: int, hi: int, pattern: np.ndarray) -> tuple[int, int, int]:
        """Longest match among a few candidates at once: full common prefixes, one vectorised read.

        Candidates are sorted, so those sharing the longest common prefix form a contiguous block.
        """
        starts = self.num_tokens - np.asarray(self.suffix_array[lo:hi]).astype(np.int64)
        index = starts[:, None] - 1 - np.arange(len(pattern))[None, :]  # reversed suffix, token by token
        windows = self._stream_tokens(index)
        mismatch = windows != pattern[None, :]
        lcp = np.where(mismatch.any(1), mismatch.argmax(1), len(pattern))
        best = int(lcp.max())
        block = np.nonzero(lcp == best)[0]
        return best, lo + int(block[0]), lo + int(block[-1]) + 1

    def continuations(self, lo: int, hi: int, depth: int, max_support: int = 1000) -> np.ndarray:
        """Continuations of the occurrences in `[lo, hi)`: `int64[count, depth]`, `-1` after a document end.

        More than `max_support` occurrences are subsampled with a uniform deterministic stride (B.11 item 9: the
        public engine strides too; the thesis says "uniformly").
        """
        count = hi - lo
        stride = max(1, -(-count // max_support))
        positions = np.asarray(self.suffix_array[lo:hi:stride][:max_support]).astype(np.int64)
        starts = self.num_tokens - positions  # first continuation token (stream index)
        index = starts[:, None] + np.arange(depth)[None, :]
        values = self._stream_tokens(index)
        # a separator ends the document, and so do the stream's end and an id past the header's vocabulary (a corrupt
        # `tokens.u32`, whose contents are not read at load): drafted, it would fail the target's embedding
        ended = np.cumsum((values < 0) | (values == SEPARATOR) | (values >= self.header.vocab_size), axis=1) > 0
        values[ended] = -1
        return values
