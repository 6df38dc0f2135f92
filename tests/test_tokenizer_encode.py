"""CheckpointTokenizer.encode (encode_batch_fast, which releases the GIL and keeps neither
offsets nor token strings, so freeing a huge prompt's encoding is cheap) gives the ids of the
tokenizer's own plain `encode`, on any text: special tokens, whitespace runs, unicode."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_kit import write_tokenizer_checkpoint

from glm53.engine.tokenizer import CheckpointTokenizer
from glm53.models.tokenizer import SPECIAL_TOKENS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return CheckpointTokenizer.from_dir(write_tokenizer_checkpoint(tmp_path_factory.mktemp("tok")))


PIECES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(SPECIAL_TOKENS),
    st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "   \n ", "é", "héllo", "日本語", "🙂", "x1"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join))
def test_encode_gives_the_plain_encode_ids(tokenizer, text):
    plain = tokenizer.hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text) == plain


def test_a_long_prompt_gives_the_plain_encode_ids(tokenizer):
    text = " ".join(["alpha", "héllo  world", "<|user|>", "42\n\n", "日本"] * 20_000)
    assert (
        tokenizer.encode(text) == tokenizer.hf_tokenizer.encode(text, add_special_tokens=False).ids
    )


@pytest.mark.parametrize("margin", [-1, 0, 1])
def test_a_prompt_that_fills_the_context_is_refused_with_its_token_count(tokenizer, margin):
    """At `context_length` tokens or more: PromptTooLong naming the count the plain encode
    gives (the scheduler's own refusal, with the same message); below it, the ids."""
    from glm53.engine.base import PromptTooLong

    text = "alpha héllo <|user|> 42\n\n日本 " * 50
    n = len(tokenizer.hf_tokenizer.encode(text, add_special_tokens=False).ids)
    context = n + margin
    if n >= context:
        with pytest.raises(PromptTooLong) as err:
            tokenizer.encode(text, context)
        assert (err.value.num_prompt_tokens, err.value.context_length) == (n, context)
    else:
        assert len(tokenizer.encode(text, context)) == n
