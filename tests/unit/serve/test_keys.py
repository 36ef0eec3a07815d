"""API keys: the file's format, checks, lookup and reload."""

from __future__ import annotations

import pytest

from symbiosis.serve.keys import ApiKeys, KeyFileError, read_key_file


def test_keys_map_to_their_tenant_and_nothing_else(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nalice alice-key-0123456789abcdef\n\nalice alice-second-key-0123456789\n"
                    "bob bob-key-0123456789abcdef\n")
    keys = ApiKeys(path)
    assert keys.tenant_of("alice-key-0123456789abcdef") == "alice"
    assert keys.tenant_of("alice-second-key-0123456789") == "alice"
    assert keys.tenant_of("bob-key-0123456789abcdef") == "bob"
    for wrong in ("", None, "bob-key-0123456789abcde", "bob-key-0123456789abcdef ", "alice", "\udcff" * 20):
        assert keys.tenant_of(wrong) is None
    assert keys.tenants == {"alice", "bob"}
    assert "alice-key" not in repr(keys.__dict__)  # only digests are held


@pytest.mark.parametrize("text, message", [
    ("alice\n", "expected `TENANT_NAME API_KEY`"),
    ("alice key0123456789abcdef extra\n", "expected `TENANT_NAME API_KEY`"),
    ("al/ice key0123456789abcdef\n", "tenant name"),
    ("alice short\n", "shorter than 16"),
    ("alice key0123456789abcdef\nbob key0123456789abcdef\n", "already belongs to tenant 'alice'"),
    ("# nothing\n", "holds no"),
])
def test_bad_key_files_are_refused_with_the_line(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=message):
        read_key_file(path)


def test_reload_swaps_the_keys_and_keeps_them_when_the_file_is_bad(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice alice-key-0123456789abcdef\nbob bob-key-0123456789abcdef\n")
    keys = ApiKeys(path)
    path.write_text("alice alice-key-0123456789abcdef\n")
    assert "1 keys of 1 tenants" in keys.reload()
    assert keys.tenant_of("bob-key-0123456789abcdef") is None
    path.write_text("alice tooshort\n")
    assert "old ones stay" in keys.reload()
    assert keys.tenant_of("alice-key-0123456789abcdef") == "alice"
