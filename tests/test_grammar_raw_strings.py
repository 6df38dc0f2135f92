"""String tool arguments are raw text between <arg_value> and </arg_value> (GLM's tool-call
markup), so their `pattern`, `format` and length limits are enforced by glm53's own lark regexes
(glm53.engine.grammar._raw_string), not by llguidance's JSON Schema compiler. These tests run
llguidance's real matcher over a real tokenizer: what a value may be, and that it means what
JSON Schema means (a pattern is a search; ^ and $ anchor), with llguidance's own JSON Schema
compiler as the reference for the pattern's meaning."""

import pytest
from llguidance import LLMatcher

from glm53.engine.grammar import FORMATS, GrammarError, _raw_string, ll_tokenizer
from glm53.engine.tokenizer import CheckpointTokenizer
from glm53.models.tokenizer import write_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 2048, "", 4096)
    (d / "config.json").write_text("{}")
    return CheckpointTokenizer.from_dir(str(d))


def _accepts(tok, grammar: str, text: str) -> bool:
    matcher = LLMatcher(ll_tokenizer(tok), grammar)
    ids = tok.hf_tokenizer.encode(text, add_special_tokens=False).ids
    return (
        matcher.try_consume_tokens(ids) == len(ids)
        and matcher.is_accepting()
        and not matcher.is_error()
    )


def _raw(schema):
    return LLMatcher.grammar_from_lark(f"start: V\nV: {_raw_string(schema, 'p')}")


PATTERNS = ["ab", "^ab$", "^ab", "ab$", "^a|b$", r"^\d{3}-\w+$", "[^x]y", r"a\$"]
TEXTS = ["ab", "xab", "abx", "ax", "xb", "xax", "123-ab_c", "12-ab", "zy", "xy", "a$", "a"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_means_what_llguidance_json_schema_means(tok, pattern):
    # the reference: the same pattern on a JSON string (quoted), by llguidance's own compiler
    reference = LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
    raw = _raw({"type": "string", "pattern": pattern})
    for text in TEXTS:
        assert _accepts(tok, raw, text) == _accepts(tok, reference, f'"{text}"'), (pattern, text)


def test_a_value_never_holds_the_closing_markup(tok):
    raw = _raw({"type": "string", "pattern": "a"})
    assert _accepts(tok, raw, "xa")
    assert not _accepts(tok, raw, "a</arg_value>")


def test_length_limits_and_pattern_hold_together(tok):
    raw = _raw({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4})
    assert [_accepts(tok, raw, t) for t in ["a", "ab", "abcd", "abcde", "aB"]] == [
        False,
        True,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("date", "2026-12-01", "2026-13-01"),
        ("time", "23:59:60.5+01:00", "24:00:00Z"),
        ("date-time", "2026-12-01T22:30:00Z", "2026-12-01 22:30"),
        ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"),
        ("ipv4", "192.168.0.255", "192.168.0.256"),
        ("email", "a.b+c@example.org", "a@b"),
        ("hostname", "api.example-1.org", "-bad.org"),
        ("uri", "https://example.org/x?y=1", "no scheme"),
    ],
)
def test_each_format_takes_the_whole_value(tok, fmt, good, bad):
    raw = _raw({"type": "string", "format": fmt})
    assert _accepts(tok, raw, good)
    assert not _accepts(tok, raw, bad)
    assert not _accepts(tok, raw, good + " and more")


def test_every_format_compiles(tok):
    for fmt in FORMATS:
        grammar = _raw({"type": "string", "format": fmt})
        assert LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tok))[0] is False


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(GrammarError) as info:
        _raw_string({"type": "string", "format": "credit-card"}, "tools[0].x")
    assert info.value.path == "tools[0].x.format" and "credit-card" in str(info.value)


def test_an_anchor_inside_a_group_is_refused_by_name():
    with pytest.raises(GrammarError) as info:
        _raw_string({"type": "string", "pattern": "(^a)b"}, "tools[0].x")
    assert info.value.path == "tools[0].x.pattern"
