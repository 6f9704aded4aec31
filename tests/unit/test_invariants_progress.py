"""Progress rows (``fthsdp.launch.progress``): what the trainer writes reads back as the same typed row, torn and
foreign lines are skipped, keys the row does not name are kept."""

from __future__ import annotations

import json
import pathlib

from fthsdp.launch.progress import ProgressRow, ProgressTail, parse_line, progress_path, read_progress, steps_of


def test_a_written_row_reads_back_the_same() -> None:
    row = ProgressRow("step", 12.5, replica=1, incarnation="abc", mode="fthsdp", step=7, loss=None, epoch=3,
                      joined=True, batches=[[0, 7], [1, 7]], catchup={"bytes": 10})
    assert parse_line(row.line()) == row
    assert json.loads(row.line())["joined"] is True and "loss" not in json.loads(row.line())


def test_reading_skips_torn_and_foreign_lines_and_keeps_extra_keys(tmp_path: pathlib.Path) -> None:
    path = progress_path(tmp_path, 0)
    assert read_progress(path) == []  # not written yet
    lines = [json.dumps({"event": "start", "t": 1.0, "replica": 0, "joining": False, "resumed_from": None}),
             "not json}",
             json.dumps({"event": "checkpoint", "t": 2.0, "step": 5, "save_s": 0.25}),
             json.dumps({"event": "step", "t": 3.0, "step": 5, "loss": 1.5}),
             '{"event": "step", "t": 4.0, "st']  # killed mid-write
    path.write_text("\n".join(lines))
    rows = read_progress(path)
    assert [x.event for x in rows] == ["start", "checkpoint", "step"]
    assert rows[1].extra == {"save_s": 0.25} and rows[1].to_json()["save_s"] == 0.25
    assert steps_of(rows) == [ProgressRow("step", 3.0, step=5, loss=1.5)]


def test_a_tail_reads_what_was_appended_since_and_waits_for_a_torn_line_to_end(tmp_path: pathlib.Path) -> None:
    path = progress_path(tmp_path, 0)
    tail = ProgressTail(path)
    assert tail.rows() == []  # not written yet
    a, b, c = (ProgressRow("step", float(i), step=i) for i in range(3))
    path.write_text(a.line() + "not json}\n")
    assert tail.rows() == [a] == read_progress(path)
    with open(path, "a") as f:
        f.write(b.line()[:10])  # half a line: not a row yet
        f.flush()
        assert tail.rows() == [a]
        f.write(b.line()[10:] + c.line())
    assert tail.rows() == [a, b, c] == read_progress(path)
    path.write_text(c.line())  # a new, shorter file: read from its start
    assert tail.rows() == [c]


def test_a_tail_skips_bytes_that_are_not_text_and_rereads_a_replaced_file(tmp_path: pathlib.Path) -> None:
    path = progress_path(tmp_path, 0)
    tail = ProgressTail(path)
    a, b = ProgressRow("step", 1.0, step=1, error="café"), ProgressRow("step", 2.0, step=2)
    path.write_bytes(a.line().encode() + b'{"event": "st\xff\xfe}\n' + b.line().encode())
    assert tail.rows() == [a, b]  # a torn, undecodable line between them is skipped, not fatal
    replaced = tmp_path / "new"
    replaced.write_text(b.line() + a.line())  # as long as before or longer, but another file
    replaced.replace(path)
    assert tail.rows() == [b, a]
