"""`custom_generate/generate.py` of a published hf-accel drafter: speculative decoding from the repository's name.

[`hf_accel.hub.save_artifact`] with `drafter=` copies this file into the artifact as `custom_generate/generate.py`,
with `DRAFTER` (the drafter's registered name) and `ARTIFACT` (where its files are: the saved directory, or the
repository id once [`~hf_accel.hub.push_to_hub`] or [`~hf_accel.hub.populate_hub_cache`] publishes it) filled in.
transformers then runs hf-accel's engine from the repository's name alone:

```python
out = model.generate(**inputs, custom_generate="ORG/NAME", trust_remote_code=True, max_new_tokens=128)
```

(transformers loads this file and calls its `generate(model=..., **arguments of the call)` in place of its own).
Greedy output is token-identical to plain greedy `generate`. The drafter is built once per model and reused, so
what it learns about pass costs carries over between calls; `drafter=` overrides it. The index's tokenizer check
uses the call's `tokenizer=` or, without one, the tokenizer of `model.name_or_path` (a Hub id: at its default
branch; transformers does not record the revision a model was loaded from, so a model loaded with `revision=` passes
`tokenizer=` loaded with the same one). Needs `hf-accel` installed (`custom_generate/requirements.txt`).
"""

import copy
import os
import weakref


DRAFTER = "ngram"
ARTIFACT = None

_drafters = weakref.WeakKeyDictionary()  # model -> its drafter, built on the first call


def generate(model, *args, drafter=None, tokenizer=None, **kwargs):
    from transformers import AutoTokenizer, GenerationMixin, StoppingCriteriaList, StopStringCriteria

    try:
        from hf_accel.speculative import custom_generate
        from hf_accel.speculative.drafters import build_drafter
        from hf_accel.speculative.drafters.index import TokenizerMismatchError
    except ImportError as err:  # an hf-accel older than the one that wrote this file (`requirements.txt` may pass)
        if not (err.name or "").startswith("hf_accel"):  # one of hf-accel's own dependencies: its own error
            raise
        raise ImportError(
            f"this drafter's custom_generate/generate.py needs a newer hf-accel than the one installed ({err}): run "
            "`pip install -U hf-accel`"
        ) from None

    call_tokenizer = tokenizer  # stop strings use only this one, as in `generate`, on every call alike
    if drafter is None:
        drafter = _drafters.get(model)
    if drafter is None and ARTIFACT is not None and os.path.isabs(ARTIFACT) and not os.path.isdir(ARTIFACT):
        raise FileNotFoundError(
            f"this drafter's custom_generate/generate.py drafts from the folder it was saved in, {ARTIFACT}, which is "
            "not there (moved?): point it at the folder it is in with "
            f"`hf_accel.hub.write_custom_generate(FOLDER, {DRAFTER!r}, ABSOLUTE_PATH_OF_FOLDER)`"
        )
    if drafter is None:
        if tokenizer is None:
            try:
                # never the repository's own tokenizer code: the model's trust covers its modeling code at the
                # revision it was loaded from, which the model does not record (a checkpoint's tokenizer is a library
                # class; one that needs code is one clear error asking for `tokenizer=`, not a prompt)
                tokenizer = AutoTokenizer.from_pretrained(model.name_or_path, trust_remote_code=False)
            except (OSError, ValueError) as err:
                raise ValueError(
                    f"cannot load the tokenizer of {model.name_or_path!r} to check the drafter against it: pass "
                    "`tokenizer=` to `generate`"
                ) from err
        try:
            drafter = build_drafter(DRAFTER, ARTIFACT, model, tokenizer)
        except TokenizerMismatchError as err:
            if call_tokenizer is not None or os.path.isdir(model.name_or_path):  # a local model has no revisions
                raise
            raise TokenizerMismatchError(
                f"{err} (checked against the tokenizer of {model.name_or_path!r} at its default branch, not "
                "necessarily the revision the model was loaded from: pass that revision's tokenizer as `tokenizer=`)"
            ) from err
        _drafters[model] = drafter
    # transformers drops `tokenizer` before a callable `custom_generate`, so stop strings become a criterion here
    stop_strings = kwargs.pop("stop_strings", None)
    config = kwargs.get("generation_config")
    if config is not None and getattr(config, "stop_strings", None):
        stop_strings = stop_strings or config.stop_strings
        config = copy.deepcopy(config)
        config.stop_strings = None
        kwargs["generation_config"] = config
    # `generate` fills a config's unset fields from the model's own (its generation_config.json): only a call's
    # `stop_strings=None` keeps the model's stop strings from reaching transformers without the tokenizer
    model_stop_strings = getattr(getattr(model, "generation_config", None), "stop_strings", None)
    if model_stop_strings:
        stop_strings = stop_strings or model_stop_strings
        kwargs["stop_strings"] = None
    if stop_strings:
        if call_tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass `tokenizer=` to `generate`")
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(call_tokenizer, stop_strings))
        kwargs["stopping_criteria"] = criteria
    return GenerationMixin.generate(model, *args, custom_generate=custom_generate, drafter=drafter, **kwargs)
