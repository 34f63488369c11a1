"""Prompt rendering with a real transformers tokenizer (built in the test, nothing downloaded)."""
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from mtrain.data import CharTokenizer, PromptError, PromptSample, render_prompt, tokenize_prompts

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
WORDS = "What is 1 + 2 ? Be brief . system user assistant [ ] Answer with just the number".split()


def hf_tokenizer(chat_template=TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=chat_template)


def test_chat_template_with_generation_prompt_and_system_prompt():
    tok = hf_tokenizer()
    text, ids = render_prompt(tok, "What is 1 + 2 ?", system_prompt="Be brief .")
    assert text == "<s>[system] Be brief . [user] What is 1 + 2 ? [assistant]"
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # no second BOS from encode
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["[", "assistant", "]"]
    assert tok.unk_token_id not in ids


def test_message_prompts_keep_their_own_system_message():
    tok = hf_tokenizer()
    msgs = [{"role": "system", "content": "Be brief ."}, {"role": "user", "content": "What is 1 + 2 ?"}]
    text, _ = render_prompt(tok, msgs, system_prompt="ignored because one is present")
    assert text == "<s>[system] Be brief . [user] What is 1 + 2 ? [assistant]"


def test_plain_text_mode_uses_the_tokenizers_specials():
    tok = hf_tokenizer()
    text, ids = render_prompt(tok, "What is 1 + 2 ?", apply_chat_template=False, system_prompt="Be brief .")
    assert text == "Be brief .\n\nWhat is 1 + 2 ?"
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1 and len(ids) == 1 + 9


def test_errors_name_the_sample():
    with pytest.raises(PromptError, match="sample 4: the tokenizer has no chat template; set "
                                          "data.apply_chat_template=false"):
        render_prompt(hf_tokenizer(chat_template=None), "What is 1 + 2 ?", sample_id=4)
    with pytest.raises(PromptError, match="sample 5: the prompt is a list of chat messages"):
        render_prompt(hf_tokenizer(), [{"role": "user", "content": "x"}], apply_chat_template=False, sample_id=5)


def test_tokenize_prompts_overlong_error_or_drop(caplog):
    tok = CharTokenizer()
    samples = [PromptSample(0, "What is 1 + 2?", "3"), PromptSample(1, "What is 1 + 2? " * 10, "3")]
    limit = len(render_prompt(tok, samples[0].prompt)[1])
    with pytest.raises(PromptError, match=f"sample 1: prompt has [0-9]+ tokens > rollout.max_prompt_len={limit}"):
        tokenize_prompts(samples, tok, max_prompt_len=limit)
    kept = tokenize_prompts(samples, tok, max_prompt_len=limit, drop_overlong=True)
    assert [t.sample.index for t in kept] == [0] and len(kept[0].ids) == limit
    assert "dropped 1 of 2 prompts longer than" in caplog.text
    with pytest.raises(PromptError, match="every prompt is longer than max_prompt_len=3"):
        tokenize_prompts(samples, tok, max_prompt_len=3, drop_overlong=True)
