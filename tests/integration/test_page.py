"""The lighthouse's page at ``/`` (lighthouse/page.py) of a live lighthouse with emulated replicas (one fails
and rejoins) rendered by headless Chromium: the DOM after its script ran names the replicas, roles and epochs
fetched live from ``/status``, and the screenshot shows the timeline. (The pure rendering is tested in
tests/unit/test_lighthouse_page.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from fthsdp.bench.emulate import Emulator
from lighthouse import membership as m
from lighthouse.stragglers import Pace
from tests.helpers.lighthouse import ServerThread, make_config, wait_until

T = TypeVar("T")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# A 3 s heartbeat timeout: the killed replica is declared dead within seconds, and a loaded machine (the test
# process hosts the lighthouse and the emulator) does not make the live ones miss it.
POLICY = m.Policy(min_replicas=1, heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, confirm_age_s=0.6,
                  expected_replicas=3)
PACES = {"page-00000": (0.3, 0.0), "page-00001": (0.1, 0.2), "page-00002": (0.1, 0.2)}
DIGESTS = {"page-00000": "00aa00aa00aa00aa", "page-00001": "00aa00aa00aa00aa", "page-00002": "ff00ff00ff00ff00"}
# The page's colours (lighthouse/page.py :root) that the screenshot must contain.
ACTIVE, FAILURE, REJOIN = (0x2E, 0x7D, 0x32), (0xC6, 0x28, 0x28), (0x15, 0x65, 0xC0)


# --- a live lighthouse in headless Chromium -------------------------------------------------------------------


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-emulator", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 20.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _get_status(s: ServerThread) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{s.http}/status", timeout=5) as r:
        return json.load(r)  # type: ignore[no-any-return]


def _history_has(s: ServerThread, needle: str) -> Callable[[], bool]:
    return lambda: any(needle in e["reason"] for e in _get_status(s)["history"])


@pytest.fixture(scope="module")
def cluster() -> Iterator[ServerThread]:
    """A lighthouse and 3 emulated replicas; replica page-00001 is killed, declared dead, and rejoins. Shared by
    the tests of this module (they only read it)."""
    server = ServerThread(make_config(POLICY))
    lt = LoopThread()
    emus: list[Emulator] = []
    try:
        async def make(n: int, keep: slice) -> Emulator:
            emu = Emulator(server.addr, n, prefix="page")
            emu.replicas = emu.replicas[keep]
            emus.append(emu)
            await emu.start()
            return emu

        first = lt.run(make(3, slice(None)))
        wait_until(lambda: len(_get_status(server)["members"]) == 3 and _get_status(server)["epoch"] >= 1,
                   timeout=15, what="3 replicas in an epoch")
        lt.run(first.kill(first.replicas[1]))
        wait_until(_history_has(server, "replica page-00001 dead"), timeout=15, what="page-00001 declared dead")
        lt.run(make(2, slice(1, 2)))  # page-00001 again: a new incarnation, joining
        wait_until(_history_has(server, "replica page-00001 caught up, now active"), timeout=15,
                   what="page-00001 rejoined and active")
        # State digests with the heartbeats: page-00002's differs from the other two's at step 40.
        live = {r.client.replica_id: r for emu in emus for r in emu.replicas if not r.stop.is_set()}
        for rid, digest in DIGESTS.items():
            live[rid].client.digest = (40, digest)
        wait_until(lambda: (_get_status(server).get("agreement") or {}).get("differ") == ["page-00002"],
                   timeout=15, what="the digests at the lighthouse")
        # Paces with the heartbeats, three distinct steps: the others wait on page-00000, three times slower.
        for step in (40, 41, 42):
            for rid, r in live.items():
                r.client.pace = Pace(step, *PACES[rid])
            wait_until(lambda s=step: all((x.get("pace") or {}).get("step") == s  # type: ignore[misc]
                                          for x in _get_status(server)["members"]),
                       timeout=15, what=f"the paces of step {step} at the lighthouse")
        assert [x["replica_id"] for x in _get_status(server)["stragglers"]] == ["page-00000"]
        yield server
    finally:
        for emu in emus:
            try:
                lt.run(emu.close(), timeout=10)
            except Exception as e:  # noqa: BLE001  a failed close must not hide the test's own failure
                print(f"emulator close failed: {e!r}")
        lt.stop()
        server.stop()


def _chromium(tmp: pathlib.Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} not found: `make setup` installs Debian's chromium (scripts/system-deps.sh)")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          check=False)


def test_live_page_in_chromium(cluster: ServerThread, tmp_path: pathlib.Path) -> None:
    url = f"http://{cluster.http}/"
    now = _get_status(cluster)
    # The script fetches /status at once; the virtual-time budget lets it run (and redraw) before the dump.
    r = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", url)
    dom = r.stdout
    after = _get_status(cluster)
    assert 'data-rendered="js"' in dom, f"the page's script did not render (stderr: {r.stderr[-2000:]})"
    assert 'data-source="live"' in dom, "the page did not redraw from a live GET /status"
    shown = int(re.search(r'id="epoch">(\d+)<', dom).group(1))  # type: ignore[union-attr]
    assert now["epoch"] <= shown <= after["epoch"]
    roles = {x["replica_id"]: {x["role"]} for x in now["members"]}
    for x in after["members"]:
        roles.setdefault(x["replica_id"], set()).add(x["role"])
    for rid, possible in roles.items():
        m_ = re.search(rf'<tr data-replica="{rid}" data-role="(\w+)"', dom)
        assert m_ is not None and m_.group(1) in possible, (rid, possible)
    assert 'class="role active">active<' in dom
    for e in now["history"]:
        assert f'<tr data-epoch="{e["epoch"]}">' in dom
    # The timeline marks page-00001's failure and its rejoin, in the epochs whose reasons say so.
    dead = next(e["epoch"] for e in now["history"] if "replica page-00001 dead" in e["reason"])
    back = next(e["epoch"] for e in now["history"] if "replica page-00001 ready to join" in e["reason"])
    row = re.search(r'<tr data-replica="page-00001"><td>page-00001</td>(.*?)</tr>', dom)
    assert row is not None
    assert f'data-epoch="{dead}" data-kind="failure"' in row.group(1)
    assert f'data-epoch="{back}" data-kind="rejoin"' in row.group(1)
    assert dead < back
    # Each replica's state digest, and whether they agree: page-00002's is drawn as the one that differs.
    assert re.search(r'id="agreement">DIFFER \(page-00002\) at step 40<', dom), "agreement not drawn"
    for rid, digest in DIGESTS.items():
        cls = "digest differ" if rid == "page-00002" else "digest"
        assert re.search(rf'<tr data-replica="{rid}" data-role="\w+">.*?<span class="{cls}">{digest} \(40\)</span>',
                         dom), (rid, digest)
    # Each replica's pace, and the straggler: page-00000, drawn as slow and named in the summary.
    assert re.search(r'id="stragglers">page-00000 3x<', dom), "stragglers not drawn"
    for rid, (compute, wait) in PACES.items():
        cls = "pace slow" if rid == "page-00000" else "pace"
        assert re.search(rf'<tr data-replica="{rid}" data-role="\w+">.*?<span class="{cls}">{compute:.3f} / {wait:.3f}'
                         '</span>', dom), (rid, compute)


def _colours(png: pathlib.Path) -> tuple[Any, int]:
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(str(png))
    rgb = (img[..., :3] * 255).round().astype(np.int16) if img.dtype.kind == "f" else img[..., :3].astype(np.int16)
    flat = rgb.reshape(-1, 3)
    return flat, len(np.unique(flat, axis=0))


def _has_colour(flat: Any, rgb: tuple[int, int, int], min_pixels: int = 50) -> bool:
    import numpy as np

    return int((np.abs(flat - np.array(rgb)).max(axis=1) <= 3).sum()) >= min_pixels


def test_live_page_screenshot(cluster: ServerThread, tmp_path: pathlib.Path) -> None:
    png = tmp_path / "page.png"
    r = _chromium(tmp_path, "--virtual-time-budget=2500", "--window-size=1280,1400", "--hide-scrollbars",
                  f"--screenshot={png}", f"http://{cluster.http}/")
    assert png.exists() and png.stat().st_size > 0, f"no screenshot (stderr: {r.stderr[-2000:]})"
    flat, distinct = _colours(png)
    white = int((flat >= 250).all(axis=1).sum())
    assert distinct >= 20, f"the screenshot is nearly blank ({distinct} colours)"
    assert white < 0.98 * len(flat), "the screenshot is nearly all white"
    # The timeline drew members (green), page-00001's failure (red) and its rejoin (blue).
    assert _has_colour(flat, ACTIVE) and _has_colour(flat, FAILURE) and _has_colour(flat, REJOIN)


def test_screenshot_check_can_fail(tmp_path: pathlib.Path) -> None:
    """The check above can fail: a blank page has no timeline colours."""
    blank = tmp_path / "blank.html"
    blank.write_text("<!doctype html><html><body></body></html>")
    png = tmp_path / "blank.png"
    _chromium(tmp_path, "--window-size=400,300", f"--screenshot={png}", blank.as_uri())
    flat, distinct = _colours(png)
    assert distinct < 20
    assert not _has_colour(flat, FAILURE)


def test_lighthouse_metrics_count_the_failure_and_the_rejoin(cluster: ServerThread) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{cluster.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    counted = {s.labels["kind"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "fthsdp_lighthouse_membership_events_total"}
    # Every epoch formed is still in the status history (fewer than 32): the counters must add up to it.
    history = _get_status(cluster)["history"]
    assert history[0]["epoch"] == 1
    expected: dict[str, int] = {}
    for e in history[1:]:  # the bootstrap epoch is not counted
        for ev in e["events"]:
            expected[ev["kind"]] = expected.get(ev["kind"], 0) + 1
    assert expected.get("failure", 0) >= 1 and expected.get("rejoin", 0) >= 1  # page-00001 died and rejoined
    assert {k: int(v) for k, v in counted.items() if v} == expected


def test_page_with_a_job_token_in_chromium(start_server: Callable[..., ServerThread], tmp_path: pathlib.Path) -> None:
    """With a job token every HTTP path needs it; a browser gives it as the Basic password (here in the URL),
    and the page's own fetches of /status still work."""
    from lighthouse.security import ServerSecurity

    token = "page-test-token-0123456789"
    server = start_server(POLICY, security=ServerSecurity(token=token))
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{server.http}/", timeout=5)
    assert refused.value.code == 401
    r = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", f"http://viewer:{token}@{server.http}/")
    assert 'data-rendered="js"' in r.stdout, r.stderr[-2000:]
    assert 'data-source="live"' in r.stdout, "the page could not fetch /status with the browser's credentials"
