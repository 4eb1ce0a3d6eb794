"""Atomic JSONL writes and line-numbered read errors."""

import os

import pytest

from online_rlhf.jsonl import DataError, atomic_open, check_finite, read_jsonl, write_jsonl


def test_roundtrip_keeps_non_ascii(tmp_path):
    recs = [{"id": "1", "text": "日本語 🙂"}, {"id": "2", "text": "naïve"}]
    p = tmp_path / "a.jsonl"
    assert write_jsonl(p, recs) == 2
    assert read_jsonl(p) == recs
    assert "日本語" in p.read_text(encoding="utf-8")


def test_bad_line_names_file_and_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": 1}\n\n{"id": 2\n')
    with pytest.raises(DataError, match=r"a\.jsonl:3: not valid JSON"):
        read_jsonl(p)


def test_non_object_line_is_refused(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r":2: expected a JSON object"):
        read_jsonl(p)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    p = tmp_path / "a.jsonl"
    write_jsonl(p, [{"id": "old"}])

    def gen():
        yield {"id": "new"}
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        write_jsonl(p, gen())
    assert read_jsonl(p) == [{"id": "old"}]
    assert os.listdir(tmp_path) == ["a.jsonl"]


def test_nan_is_refused_with_record_id(tmp_path):
    with pytest.raises(DataError, match="id='x'"):
        write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "reward": float("nan")}])


def test_check_finite():
    assert check_finite(1.5, "r") == 1.5 and check_finite(2, "r") == 2.0
    with pytest.raises(DataError, match="rec 3"):
        check_finite(float("inf"), "rec 3")
    for text_or_flag in ("abc", "1.5", True):  # a broken reward source, not a number
        with pytest.raises(DataError, match="not a number"):
            check_finite(text_or_flag, "rec 3")


def test_atomic_open_binary(tmp_path):
    with atomic_open(tmp_path / "b.bin", "wb") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"


def test_written_files_get_the_usual_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_jsonl(tmp_path / "a.jsonl", [{"id": 1}])
    finally:
        os.umask(old)
    assert (tmp_path / "a.jsonl").stat().st_mode & 0o777 == 0o644


def test_blank_lines_are_counted_and_noted_once_naming_the_file(tmp_path, capsys):
    from online_rlhf.jsonl import iter_jsonl

    p = tmp_path / "a.jsonl"
    p.write_text('{"id": 1}\n\n   \n{"id": 2}\n\n')
    lines = iter_jsonl(p)
    assert [ln for ln, _ in lines] == [1, 4]
    assert lines.blank_lines == 3 and lines.blank_line_numbers == [2, 3, 5]
    assert capsys.readouterr().err == f"note: skipped 3 blank line(s) in {p} (line 2, 3, 5)\n"
    p.write_text('{"id": 1}\n{"id": 2}\n')
    lines = iter_jsonl(p)
    assert read_jsonl(p) == [{"id": 1}, {"id": 2}] and list(lines) and lines.blank_lines == 0
    assert capsys.readouterr().err == ""  # nothing skipped, nothing said


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9.*Save the file as UTF-8"):
        read_jsonl(p)


def test_a_utf8_byte_order_mark_is_read_past(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes('\ufeff{"id": "a", "prompt": "café"}\n'.encode("utf-8"))
    assert read_jsonl(p) == [{"id": "a", "prompt": "café"}]


def test_a_missing_relative_file_names_where_run_loop_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"relative paths are taken from {tmp_path}"):
        read_jsonl("p/missing.jsonl")
    monkeypatch.setenv("ONLINE_RLHF_CALLER_PWD", "/somewhere/else")
    with pytest.raises(FileNotFoundError, match=f"looks for relative paths in /somewhere/else, .* then in {tmp_path}"):
        read_jsonl("p/missing.jsonl")
