"""Building Infinigram indexes: from text files, a `datasets` dataset, or the target's own answers (self-distillation).

Self-distillation (spec B.2, "Target-5M": the setting with the best acceptance) asks the target to answer prompts
greedily and indexes its responses. Ambiguities (B.11 item 3) resolved here: greedy decoding, responses only (the
prompt and chat template are not indexed: the prompt is in the context at drafting time anyway), prompts rendered and
tokenized as the benchmark does (`hf_accel.eval.prompts`: a raw prompt with the tokenizer's BOS, if it adds one),
generation stops at EOS or `max_new_tokens` (default 256). `samples=N` adds N answers per prompt sampled at
`temperature` (top-k and top-p off, as `bench generate --temperature` samples): sampled decoding leaves the greedy
answer's path, and the model's sampled answers match it better (the README's "Session 28" measures the shipped
`code-build` index, built so).

Generation is batched (prompts sorted by length to limit padding), cached and resumable: every finished answer is
appended to `<out>/self_distill.jsonl` keyed by prompt text (and whether the tokenizer added its BOS), model name and
length cap, with a fingerprint of the model's weights, their dtype and its generation config (a directory re-saved
with another model or another `generation_config.json`, or the model run in another dtype, regenerates its answers,
which replace the old ones), and a rerun skips them. Processes sharing a cache take turns through a lock file beside
it (`.self_distill.jsonl.lock`, not published). Answers cached by earlier versions, stamped with no fingerprint or with
the weights' alone, are taken as the model's when the weights match.
"""

import hashlib
import json
import math
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from ...eval.prompts import adds_special_tokens, encode_prompts
from ...log import progress_bar
from .index import IndexHeader, build_index, tokenizer_fingerprint


SELF_DISTILL_CACHE = "self_distill.jsonl"
# Held while the cache is read (its repair may truncate it), appended to or rewritten: processes sharing one cache take
# turns, so a rewrite cannot drop answers appended between its re-read and its rename. Not published (`hf-accel push`
# leaves `.*.lock` files out).
SELF_DISTILL_LOCK = f".{SELF_DISTILL_CACHE}.lock"


def iter_text_file_documents(
    paths: Iterable[str | Path], tokenizer, chunk_chars: int = 1 << 20
) -> Iterator[list[int]]:
    """Token ids of each text file (one document per file, tokenized in chunks of about `chunk_chars` characters).

    A chunk ends at a whitespace run near its end (its last line break's, else its last space's) where the text around
    the cut tokenizes as the two pieces do ([`_chunk_end`]): byte-level BPE tokenizers glue a space to the word after
    it and indentation to its line break (GPT-2, SmolLM: cut before the run), Llama 3 and Qwen glue line breaks to the
    punctuation before them (cut after the line breaks). A cut inside a word would make tokens the tokenizer never
    makes."""
    from ...training.data import read_text_file

    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        text = read_text_file(path)  # not UTF-8: one line naming the file, as every other text input
        ids, start = [], 0
        while start < len(text):
            end = _chunk_end(text, start, start + chunk_chars, tokenizer)
            ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
            start = end
        yield ids


def _chunk_end(text: str, start: int, end: int, tokenizer, margin: int = 256) -> int:
    """Where a chunk of `text` beginning at `start` ends, about `end`: the first cut, of those around the last line
    break and then the last space before `end`, whose neighbourhood (its whitespace run and `margin` characters each
    side) tokenizes whole as its two sides do. When none does because the chunk's end lies in a whitespace run (or
    word) longer than the chunk, the chunk grows to the first run after a word past `end`, or to the end of the text
    if `end` is in its last run or word. If no cut passes (a tokenizer that adds a prefix space to every call), the
    first candidate, else `end`."""
    if end >= len(text):
        return len(text)
    candidates = []
    for separator in ("\n", " "):
        candidates += [
            c for c in _cuts_at_run(text, start, text.rfind(separator, start + 1, end)) if c not in candidates
        ]
    word_then_space = re.compile(r"\S(?=\s)").search(text, end)
    if word_then_space:
        later = _cuts_at_run(text, start, word_then_space.end())
    else:  # `end` is in the text's last whitespace run or its last word: the chunk takes the rest of the text
        later = [len(text)]
    for candidate in candidates + [c for c in later if c not in candidates]:
        run_start, run_end = _run_around(text, start, candidate)
        window = text[max(start, run_start - margin) : run_end + margin]
        left = candidate - max(start, run_start - margin)
        pieces = [
            tokenizer(part, add_special_tokens=False)["input_ids"] for part in (window, window[:left], window[left:])
        ]
        if pieces[0] == pieces[1] + pieces[2]:
            return candidate
    return candidates[0] if candidates else end


def _run_around(text: str, start: int, cut: int) -> tuple[int, int]:
    """The whitespace run (not before `start`) that `cut` is in or next to, as `(begin, end)`: a window checking the cut
    must hold all of it, since a tokenizer splits a run by its whole length (a run of 300 line breaks then indentation
    is one SmolLM piece)."""
    begin, end = cut, cut
    while begin > start and text[begin - 1].isspace():
        begin -= 1
    while end < len(text) and text[end].isspace():
        end += 1
    return begin, end


def _cuts_at_run(text: str, start: int, cut: int) -> list[int]:
    """Cuts for the whitespace at `cut` (`-1`: none): before its run (GPT-2, SmolLM) and past its line breaks (Llama 3,
    Qwen), those after `start` and not inside a run of spaces (a run that began before `start`: how a tokenizer splits
    a long run depends on its end, which a window inside it does not see)."""
    if cut < 0:
        return []
    before = _run_around(text, start, cut)[0]  # the start of the whitespace run
    after = cut  # past the line breaks (not the indentation after them)
    while after < len(text) and text[after] in "\r\n":
        after += 1
    inside_run = lambda c: c < len(text) and text[c - 1].isspace() and text[c - 1] not in "\r\n" and text[c].isspace()
    return [c for c in dict.fromkeys((before, after)) if start < c <= len(text) and not inside_run(c)]


def iter_dataset_documents(
    name: str, tokenizer, split: str = "train", text_column: str = "text"
) -> Iterator[list[int]]:
    """Token ids of each record's `text_column` of a `datasets` dataset (save_to_disk directory or Hub id/files),
    tokenized as they are taken; the dataset is loaded at the call."""
    from ...loading import load_dataset_split

    data = load_dataset_split(name, split, column=text_column)  # now: a bad name fails before anything else runs
    return (tokenizer(text, add_special_tokens=False)["input_ids"] for text in data[text_column] if text)


def model_fingerprint(model) -> str:
    """A short hash of a strided sample of every parameter and its dtype: a different checkpoint saved under the same
    name (a re-converted or fine-tuned directory), or the same one run in another dtype, does not reuse cached
    answers. Parameters without data here (offloaded to
    `meta`) count by name and shape only."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # the dtype too: a bfloat16 checkpoint loaded in float32 has the same values, not the same answers
            digest.update(name.encode() + str(tuple(param.shape)).encode() + str(param.dtype).encode())
            if param.device.type != "meta":
                flat = param.detach().reshape(-1)
                digest.update(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


# generation-config fields that do not change self-distilled answers (set by `self_distill` itself, or bookkeeping)
_UNUSED_GENERATION_FIELDS = (
    "transformers_version", "_from_model_config", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict_in_generate", "output_scores", "output_logits", "pad_token_id", "max_length", "max_new_tokens",
    "do_sample", "temperature", "top_k", "top_p",
)  # fmt: skip


def answers_fingerprint(model) -> str:
    """[`model_fingerprint`] together with the model's generation config (its EOS ids, a repetition penalty, banned
    tokens...: a fixed `generation_config.json` changes greedy answers without changing a weight)."""
    settings = model.generation_config.to_diff_dict()
    for name in _UNUSED_GENERATION_FIELDS:
        settings.pop(name, None)
    generation = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(f"{model_fingerprint(model)}\0{generation}".encode()).hexdigest()[:16]


def _cache_key(
    model_name: str, text: str, max_new_tokens: int, special_tokens: bool = False, sample: str | None = None
) -> str:
    # a raw prompt given the tokenizer's special tokens (a Llama BOS) is another input than its text alone
    marker = "\0special" if special_tokens else ""
    marker += f"\0sample {sample}" if sample is not None else ""  # a greedy answer's key is the one it always had
    return hashlib.sha256(f"{model_name}\0{max_new_tokens}{marker}\0{text}".encode()).hexdigest()[:24]


def _sample_name(number: int, temperature: float, seed: int) -> str:
    """A sampled answer's name in its cache key and record: its number among the prompt's samples, the temperature and
    the seed."""
    return f"{number}@T{float(temperature)!r}:seed{seed}"  # every digit: 0.7 and 0.70000001 are two caches


def self_distill(
    model,
    tokenizer,
    prompts,
    out_dir: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    model_name: str = "",
    use_speculation: bool = True,
    progress: bool = True,
    samples: int = 0,
    temperature: float = 0.7,
    seed: int = 0,
) -> list[list[int]]:
    """Answers of `model` to `prompts` (cached in `out_dir/self_distill.jsonl`): each prompt's greedy answer, then
    `samples` sampled ones per prompt; returns their response token ids, greedy answers first, in the prompts' order.

    Args:
        model (`PreTrainedModel`), tokenizer: the target and its tokenizer.
        prompts (`list[BenchPrompt]`): rendered prompts (`hf_accel.eval.prompts.load_prompts`).
        out_dir (`str` or `Path`): where the cache file lives.
        max_new_tokens (`int`, *optional*, defaults to 256): answer length cap.
        batch_size (`int`, *optional*, defaults to 8): prompts per `generate` call.
        model_name (`str`, *optional*): part of the cache key.
        use_speculation (`bool`, *optional*, defaults to `True`): generate through hf-accel's engine with the
            context-only n-gram drafter (same greedy output, fewer target passes).
        progress (`bool`, *optional*, defaults to `True`): a progress bar over the answers still to generate.
        samples (`int`, *optional*, defaults to 0): sampled answers per prompt, besides the greedy one.
        temperature (`float`, *optional*, defaults to 0.7): their temperature (top-k and top-p off).
        seed (`int`, *optional*, defaults to 0): their seed. A sampled batch seeds torch's CPU generator with `seed`
            and its first answer's key (and restores it after; not safe against another thread drawing from it
            meanwhile), and the engine samples each row's positions from that: a rerun with the same batches (batch
            size, answers already cached) samples the same answers, other batches other, equally valid ones. Without
            speculation on an accelerator, plain `generate` samples from the device's generator, which is not seeded.
    """
    if samples < 0 or (samples and not (math.isfinite(temperature) and temperature > 0)):
        raise ValueError(f"samples must be >= 0 and the temperature positive, got {samples} and {temperature}")
    cache_file = Path(out_dir) / SELF_DISTILL_CACHE
    records, num_lines = _read_self_distill_cache(cache_file)
    fingerprint, weights = answers_fingerprint(model), model_fingerprint(model)
    names = [None] + [_sample_name(k, temperature, seed) for k in range(1, samples + 1)]
    jobs = [(name, p) for name in names for p in prompts]  # greedy answers first: one `generate` mode per batch
    keys = [_cache_key(model_name, p.text, max_new_tokens, adds_special_tokens(tokenizer, p), n) for n, p in jobs]
    # records written before fingerprints (no "model"), or before the generation config was part of them (this
    # model's weights-only fingerprint), are taken as this model's, and stamped so; another model's answers are
    # regenerated and replace them
    adopted = {k for k in keys if k in records and records[k].get("model", weights) == weights}
    for key in adopted:
        records[key]["model"] = fingerprint
    done = {k: r["tokens"] for k, r in records.items() if r.get("model", fingerprint) == fingerprint}
    todo = {k: job for k, job in zip(keys, jobs) if k not in done}
    todo = sorted(todo.items(), key=lambda kj: (kj[1][0] is not None, len(kj[1][1].text)))
    # one record per key: readers of the file (heal corpora, simulations) take every line, so the file is rewritten
    # when records were stamped or are replaced, or a run killed while replacing some left duplicates, or (checked at
    # the end) another process sharing the cache appended answers to the same prompts while this one generated them
    rewrite = adopted or num_lines > len(records) or any(k in records for k, _ in todo)
    extra = {}
    if use_speculation:
        from ..generate import custom_generate
        from .infinigram import InfinigramDrafter

        extra = {"custom_generate": custom_generate, "drafter": InfinigramDrafter(None)}
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    greedy = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    sampled = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    # a batch holds greedy or sampled answers, not both
    modes = [[kj for kj in todo if (kj[1][0] is None) == greedy_mode] for greedy_mode in (True, False)]
    batches = [part[i : i + batch_size] for part in modes for i in range(0, len(part), batch_size)]
    with progress_bar(total=len(todo), progress=progress, desc="self-distill", unit="answer") as bar:
        for batch in batches:
            inputs, pad_token_id = encode_prompts(tokenizer, [p for _, (_, p) in batch])
            sample = batch[0][1][0]
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                # the CPU generator alone, which the engine draws its sampling seed from (`manual_seed` would reseed
                # the accelerators' generators too, which `fork_rng(devices=[])` does not restore)
                torch.default_generator.manual_seed(
                    int(hashlib.sha256(f"{seed}\0{batch[0][0]}".encode()).hexdigest()[:8], 16)
                )
                generated = model.generate(
                    **inputs, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                    **(greedy if sample is None else sampled), **extra,
                )[:, inputs["input_ids"].shape[1] :]  # fmt: skip
            lines = []
            for (key, (sample, prompt)), row in zip(batch, generated.tolist()):
                done[key] = _strip_after_eos(row, eos)
                records[key] = {
                    "key": key,
                    "question_id": prompt.question_id,
                    "model": fingerprint,
                    "tokens": done[key],
                    **({} if sample is None else {"sample": sample}),
                }
                lines.append(json.dumps(records[key]) + "\n")
            cache_file.parent.mkdir(parents=True, exist_ok=True)  # not before: a failed first batch leaves nothing
            # a whole batch in one unbuffered write: an interruption loses at most its tail
            with _cache_lock(cache_file), open(cache_file, "ab", buffering=0) as cache:
                cache.write("".join(lines).encode("utf-8"))
            bar.update(len(batch))
    if rewrite or todo:
        _rewrite_self_distill_cache(cache_file, adopted, fingerprint, weights)
    return [done[k] for k in keys]


def _rewrite_self_distill_cache(cache_file: Path, adopted: set[str], fingerprint: str, weights: str) -> None:
    """The cache rewritten with one record per key (the last one), the `adopted` keys' records without a fingerprint
    or with the weights-only one `weights` stamped `fingerprint`; left as it is when it already holds that. It is read
    again first, so that answers another process appended before are kept (and its answers to the same prompts, which
    it generated at the same time, not kept twice), and written atomically ([`replace_atomically`]) with the file's
    permissions: an interruption leaves a whole file. The cache lock is held from the re-read to the rename, so no
    other process appends (or rewrites) in between."""
    from ...atomic import replace_atomically

    with _cache_lock(cache_file):
        records, num_lines = _read_locked_self_distill_cache(cache_file)
        stamp = [k for k in adopted if k in records and records[k].get("model", weights) == weights]
        if not stamp and num_lines == len(records):
            return
        for key in stamp:
            records[key]["model"] = fingerprint
        mode = stat.S_IMODE(cache_file.stat().st_mode)
        replace_atomically(cache_file, _write_records, list(records.values()), mode)


def _write_records(path: Path, records: list[dict], mode: int) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.chmod(path, mode)  # the cache's own, not the umask's (an index directory shared with a group)


def _cache_lock(cache_file: Path):
    """The inter-process lock of a self-distillation cache: [`SELF_DISTILL_LOCK`] beside it (its directory must exist).
    Not reentrant across instances: a holder calls the `_locked` helpers."""
    from filelock import FileLock

    return FileLock(cache_file.parent / f".{cache_file.name}.lock")


def _read_self_distill_cache(cache_file: Path) -> tuple[dict[str, dict], int]:
    """Records already in the cache, by key (the last one of a key wins), and the number of records read. A last line
    cut short by an interruption is dropped from the file, so that the next answer starts on a line of its own; a
    whole record only missing its newline (a file saved by hand) gets one. Read under the cache lock: a line another
    process is appending is not taken for a cut one."""
    if not cache_file.is_file():  # no lock file is made for a cache that does not exist yet
        return {}, 0
    with _cache_lock(cache_file):
        return _read_locked_self_distill_cache(cache_file)


def _read_locked_self_distill_cache(cache_file: Path) -> tuple[dict[str, dict], int]:
    """[`_read_self_distill_cache`] for a caller holding the cache lock."""
    if not cache_file.is_file():
        return {}, 0
    data = cache_file.read_bytes()
    complete = whole_records(data)
    if len(complete) > len(data):
        with open(cache_file, "ab") as f:
            f.write(b"\n")
    elif len(complete) < len(data):
        with open(cache_file, "r+b") as f:
            f.truncate(len(complete))
    return parse_self_distill_records(complete, cache_file)


def whole_records(data: bytes) -> bytes:
    """The part of a self-distillation cache's bytes made of whole lines: a last line cut short by an interruption is
    left out; a whole last record only missing its newline gets one."""
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        try:
            json.loads(data[len(complete) :])
            return data + b"\n"
        except ValueError:
            pass
    return complete


def parse_self_distill_records(data: bytes, cache_file) -> tuple[dict[str, dict], int]:
    """The records of [`whole_records`]'s `data` by key (the last one of a key wins), and how many there were;
    `ValueError` in one line on a line that is not a record."""
    done, count = {}, 0
    for number, line in enumerate(data.splitlines(), 1):
        if line.strip():
            count += 1
            try:
                record = json.loads(line.decode("utf-8"))  # UnicodeDecodeError is a ValueError
                # token ids, checked here: strings or lists failed after the generation, floats in the index build
                if not isinstance(record.get("tokens"), list) or not all(type(t) is int for t in record["tokens"]):
                    raise TypeError
                done[record["key"]] = record
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(
                    f"{cache_file} line {number} is not a self-distillation record; delete the file to start over"
                ) from None
    return done, count


def _strip_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Response tokens before the first EOS (EOS itself is not indexed; the document separator ends it)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def pieces_within_vocabulary(documents: Iterable[Sequence[int]], vocab_size: int) -> Iterator[list[int]]:
    """Each document cut at the ids outside `[0, vocab_size)`, which are dropped: a model whose embedding has more rows
    than its tokenizer has ids (padded for speed) may sample them. They have no text, so no draft should hold one,
    and the tokens on either side of one do not follow each other (empty pieces are left out)."""
    for document in documents:
        piece = []
        for token in document:
            if 0 <= token < vocab_size:
                piece.append(token)
            elif piece:
                yield piece
                piece = []
        if piece:
            yield piece


def build_index_from_documents(
    documents, tokenizer, out_dir: str | Path, sources: list, tokenizer_name: str | None = None, progress: bool = True
) -> tuple[IndexHeader, float]:
    """Builds the index and returns `(header, seconds spent building)`.

    `documents` is consumed once, as the index is written ([`build_index`]): a generator that tokenizes lazily is
    never held whole. The seconds leave out the time spent producing the documents (tokenizing inputs).

    The header names the tokenizer as a published card does ([`published_name`]): a local model directory by its own
    name, not by the path it has on this machine."""
    from ...hub import published_name

    name, vocab_hash, vocab_size = tokenizer_fingerprint(tokenizer)
    name = published_name(tokenizer_name or name)
    inputs_s = [0.0]
    start = time.perf_counter()
    header = build_index(_timed(documents, inputs_s), out_dir, name, vocab_hash, vocab_size, sources, progress)
    return header, time.perf_counter() - start - inputs_s[0]


def _timed(items: Iterable, seconds: list[float]) -> Iterator:
    """`items`, adding the time spent producing each one to `seconds[0]`."""
    iterator = iter(items)
    while True:
        tic = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            seconds[0] += time.perf_counter() - tic
        yield item
