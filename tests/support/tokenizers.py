"""A tiny trained tokenizer saved as transformers saves one, and a ChatML template (the chat and structured-output
tests' checkpoints)."""

from __future__ import annotations

import os

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|User|>", "<|Assistant|>"]
CHATML = """{%- if messages[0].role not in ['system', 'user'] %}
    {{- raise_exception('Conversation roles must start with system or user') }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.role == 'tool' %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>
{% endif %}
    {{- message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}"""


def make_tokenizer(path: str, template: str | None, bos_post_processor: bool = True) -> str:
    """A byte-level BPE tokenizer (trained on a few sentences, special tokens SPECIALS, BOS ``<s>`` added by the
    post-processor when ``bos_post_processor``) saved with transformers into ``path``, with ``template``."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tok.train_from_iterator(["hello world, how are you? I am fine. You are terse, be nice."] * 20, trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=template)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path
