"""A tiny real Hugging Face tokenizer with a chat template, built offline in milliseconds.

Byte-level BPE trained on a few sentences (so every string round-trips), wrapped in
PreTrainedTokenizerFast with a ChatML-style template: enough to exercise apply_chat_template and
length filtering without any model files.
"""

import functools

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=2)
def tiny_tokenizer(with_chat_template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["What is 3 + 4? The answer is 7.", "Question: solve for x.\nAnswer:", "reason step by step"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    if with_chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast
