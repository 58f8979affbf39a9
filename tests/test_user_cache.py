"""Where smolctl keeps its cache: $SMOLCTL_CACHE, else $XDG_CACHE_HOME/smolctl (absolute only, as the XDG spec
says), else ~/.cache/smolctl; writing an entry is best effort."""

from __future__ import annotations

from pathlib import Path

from smolctl.user_cache import cache_path, derived_bytes, read_entry, save_entry


def test_the_cache_folder_follows_smolctl_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SMOLCTL_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path("a", "b.bin") == tmp_path / "mine" / "a" / "b.bin"
    monkeypatch.delenv("SMOLCTL_CACHE")
    assert cache_path("a") == tmp_path / "xdg" / "smolctl" / "a"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_path("a") == tmp_path / "home" / ".cache" / "smolctl" / "a"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_path("a") == tmp_path / "home" / ".cache" / "smolctl" / "a"


def test_entries_are_written_whole_and_a_cache_that_cannot_be_written_is_skipped(tmp_path):
    entry = tmp_path / "cache" / "kind" / "key.bin"
    assert read_entry(entry) is None and read_entry(None) is None
    save_entry(entry, b"derived")
    assert read_entry(entry) == b"derived"
    assert [p.name for p in entry.parent.iterdir()] == ["key.bin"]  # no temporary file left beside it
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    save_entry(blocked / "kind" / "key.bin", b"derived")  # no error: the run goes on without a cache
    save_entry(None, b"derived")
    assert not Path(blocked / "kind").exists()


def test_a_derived_entry_is_read_back_only_whole_and_unchanged(tmp_path):
    entry = tmp_path / "cache" / "kind" / "key.bin"
    calls = []

    def derive() -> bytes:
        calls.append(1)
        return b"0123456789"

    assert bytes(derived_bytes(entry, derive, 10)) == b"0123456789" and len(calls) == 1
    assert bytes(derived_bytes(entry, derive, 10)) == b"0123456789" and len(calls) == 1  # read back
    good = entry.read_bytes()
    for damaged in (good[:-1], b"X" + good[1:], good[:5] + bytes([good[5] ^ 1]) + good[6:], good[:10] + bytes(32)):
        entry.write_bytes(damaged)
        assert bytes(derived_bytes(entry, derive, 10)) == b"0123456789"
        assert entry.read_bytes() == good  # replaced
    calls.clear()
    assert bytes(derived_bytes(entry, lambda: b"01234", 5)) == b"01234"  # another size: not the entry's bytes
    assert bytes(derived_bytes(None, derive, 10)) == b"0123456789" and len(calls) == 1  # no cache: derived
