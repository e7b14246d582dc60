"""Errors quote at most a prefix of a long key (issue 33: a 5,000-character key was echoed whole)."""

from kvplane.store.errors import QUOTED_KEY, InvalidKey, ValueTooLarge, key_error, quoted


def test_a_short_key_is_quoted_whole():
    assert quoted("prefix-block-7") == "'prefix-block-7'"
    assert str(key_error(InvalidKey.code, "k")) == \
        "key 'k': Empty, too long, or otherwise unusable key (INVALID_KEY)"


def test_a_long_key_is_quoted_by_its_start_and_its_length():
    key = "k" * 5000
    msg = str(key_error(InvalidKey.code, key))
    assert len(msg) < 200 and "5000 bytes" in msg and "k" * QUOTED_KEY in msg
    assert len(ValueTooLarge.message(key, 10, 5)) < 200
