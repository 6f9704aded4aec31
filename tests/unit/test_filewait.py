"""``fthsdp.runtime.filewait``: a standby's wait for its gate file returns once the file exists, and sleeps
meanwhile (inotify on Linux), looking only now and then; without inotify it polls."""

from __future__ import annotations

import os
import pathlib
import sys
import threading

import pytest

from fthsdp.runtime import filewait


def _held(path: pathlib.Path) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def wait() -> None:
        filewait.wait_until_exists(str(path))
        done.set()

    t = threading.Thread(target=wait, daemon=True)  # a wait that never returns must not hang the run
    t.start()
    return t, done


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "polling"])
def test_the_wait_ends_when_the_file_appears_and_not_before(tmp_path: pathlib.Path, inotify: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    if not inotify:
        monkeypatch.setattr(filewait, "_inotify", lambda folder: None)
    gate = tmp_path / "gate"
    (tmp_path / "other").write_text("x")  # another file in the folder: no release
    t, done = _held(gate)
    assert not done.wait(0.3), "released before its gate existed"
    (tmp_path / "another").write_text("x")
    assert not done.wait(0.2)
    gate.write_text("go\n")
    assert done.wait(10), "not released once its gate existed"
    t.join(10)


def test_a_file_there_already_releases_at_once(tmp_path: pathlib.Path) -> None:
    gate = tmp_path / "gate"
    gate.write_text("go\n")
    filewait.wait_until_exists(str(gate))


def test_a_folder_that_does_not_exist_yet_falls_back_to_polling(tmp_path: pathlib.Path) -> None:
    assert filewait._inotify(str(tmp_path / "later")) is None
    gate = tmp_path / "later" / "gate"
    t, done = _held(gate)
    assert not done.wait(0.2)
    gate.parent.mkdir()
    gate.write_text("go\n")
    assert done.wait(10)
    t.join(10)


def test_with_inotify_the_wait_looks_rarely(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held for a second, a polling wait would look 20 times; this one looks about twice (its safety recheck).
    Inotify is Linux's: elsewhere there is none, and the wait polls (the test above)."""
    if not sys.platform.startswith("linux"):
        assert filewait._inotify(str(tmp_path)) is None
        return
    looks = []
    real = os.path.exists

    def counting(p: str) -> bool:
        looks.append(p)
        return real(p)

    monkeypatch.setattr(filewait.os.path, "exists", counting)
    fd = filewait._inotify(str(tmp_path))
    assert fd is not None, "no inotify here"
    os.close(fd)
    gate = tmp_path / "gate"
    t, done = _held(gate)
    assert not done.wait(1.0)
    gate.write_text("go\n")
    assert done.wait(10)
    t.join(10)
    assert len([p for p in looks if p == str(gate)]) <= 4, len(looks)
