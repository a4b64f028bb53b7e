"""Speculative decoding inside `model.generate`: the ngram (suffix-array) drafter, greedy output unchanged.

Run: python examples/speculative_generate.py
"""

from hf_accel import load_model_and_tokenizer
from hf_accel.speculative import custom_generate
from hf_accel.speculative.drafters import build_drafter


model, tokenizer = load_model_and_tokenizer("smollm2-135m")
# The shipped index of the model's own answers to 234 chat prompts (built by `hf-accel index build --self-distill
# chat_build`), plus suffixes of the prompt and the answer so far; `None` drafts from those alone. The tokens per pass
# printed below move a little from run to run: the drafter sizes its trees from the pass times it measures.
drafter = build_drafter("ngram", "smollm2-135m-chat-build", model, tokenizer)

# a held-out prompt (chat_heldout_26): no answer to it is in the index
question = "Write a Python function that checks whether two strings are anagrams of each other, ignoring case."
messages = [{"role": "user", "content": question}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

plain = model.generate(**inputs, max_new_tokens=96, do_sample=False)
fast = model.generate(**inputs, max_new_tokens=96, do_sample=False, custom_generate=custom_generate, drafter=drafter)

print(tokenizer.decode(fast[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print("identical to plain greedy generate:", plain.tolist() == fast.tolist())
stats = drafter.last_stats
print(
    f"target forward passes: {stats.target_forward_passes}, tokens per pass (bonus included): {stats.mean_accepted:.2f}"
)
