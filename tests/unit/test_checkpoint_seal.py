"""A checkpoint is read only once its seal holds (issue 41): loading one runs pickle (torch.distributed.checkpoint's
metadata), so a changed, added or missing file, a re-sealed marker without the job's key, or an unsealed checkpoint
where the job has a key is refused before any of it is opened, and the model is left as it was."""

from __future__ import annotations

import json
import pathlib
import pickle

import pytest
import torch
from torch import nn

from fthsdp.runtime import checkpoint
from fthsdp.runtime.checkpoint_seal import digest, seal
from fthsdp.runtime.errors import CheckpointRejected

KEY = "0f" * 32


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _save(root: pathlib.Path, key: str = KEY) -> checkpoint.Checkpoint:
    model, opt = _model(0)
    checkpoint.save(root, 7, 0, model, opt, torch.tensor([3, 4]), 0, b'{"side": 1}', key)
    ck = checkpoint.latest(root)
    assert ck is not None
    return ck


def _load(ck: checkpoint.Checkpoint, key: str = KEY) -> nn.Module:
    model, opt = _model(1)
    before = model.weight.detach().clone()
    try:
        checkpoint.load(ck, model, opt, 0, key)
    except CheckpointRejected:
        assert torch.equal(model.weight, before)  # nothing was read into the model
        raise
    return model


def _marker(ck: checkpoint.Checkpoint) -> dict[str, object]:
    return json.loads((ck.path / checkpoint.MARKER).read_text())  # type: ignore[no-any-return]


def _rewrite_marker(ck: checkpoint.Checkpoint, **changes: object) -> checkpoint.Checkpoint:
    meta = {**_marker(ck), **changes}
    (ck.path / checkpoint.MARKER).write_text(json.dumps(meta))
    again = checkpoint.latest(ck.path.parent)
    assert again is not None
    return again


def test_a_sealed_checkpoint_lists_every_file_and_loads(tmp_path: pathlib.Path, one_rank_group: None) -> None:
    ck = _save(tmp_path)
    files = sorted(p.name for p in ck.path.iterdir() if p.name != checkpoint.MARKER)
    assert sorted(ck.files) == files and ".metadata" in files and ck.seal == seal(KEY, ck.files)
    assert all(ck.files[n] == digest(ck.path / n) for n in files)
    assert torch.equal(_load(ck).weight, _model(0)[0].weight)


def test_a_changed_byte_is_refused(tmp_path: pathlib.Path, one_rank_group: None) -> None:
    ck = _save(tmp_path)
    data = next(p for p in ck.path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointRejected, match=data.name):
        _load(ck)


def test_a_planted_pickle_is_never_unpickled(tmp_path: pathlib.Path, one_rank_group: None) -> None:
    """Metadata replaced by a pickle that would write a file when loaded, and the marker re-sealed by someone
    without the job's key (new digests, a MAC under another key): refused, and the pickle never ran."""
    ck = _save(tmp_path)
    ran = tmp_path / "pwned"

    class Bomb:
        def __reduce__(self) -> tuple[object, ...]:
            return (pathlib.Path.write_text, (ran, "ran"))

    (ck.path / ".metadata").write_bytes(pickle.dumps(Bomb()))
    files = {**ck.files, ".metadata": digest(ck.path / ".metadata")}
    with pytest.raises(CheckpointRejected, match="changed|differ"):
        _load(ck)
    forged = _rewrite_marker(ck, files=files, seal=seal("not-the-jobs-key", files))
    with pytest.raises(CheckpointRejected, match="not this job's"):
        _load(forged)
    assert not ran.exists()


def test_added_or_missing_files_and_unsealed_checkpoints_are_refused(tmp_path: pathlib.Path,
                                                                     one_rank_group: None) -> None:
    ck = _save(tmp_path)
    (ck.path / "extra.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointRejected, match=r"added: \['extra.distcp'\]"):
        _load(ck)
    (ck.path / "extra.distcp").unlink()
    (ck.path / "fthsdp-rank0.json").unlink()
    with pytest.raises(CheckpointRejected, match=r"missing: \['fthsdp-rank0.json'\]"):
        _load(ck)
    unsealed = _rewrite_marker(_save(tmp_path / "b"), files={}, seal="")
    with pytest.raises(CheckpointRejected, match="carries no seal"):
        _load(unsealed)
    _load(unsealed, key="")  # no key (loopback default): an unsealed checkpoint loads as before


def test_without_a_key_digests_still_catch_corruption(tmp_path: pathlib.Path, one_rank_group: None) -> None:
    ck = _save(tmp_path, key="")
    assert ck.seal == "" and ck.files
    torn = next(p for p in ck.path.iterdir() if p.suffix == ".distcp")
    torn.write_bytes(torn.read_bytes()[:-8])
    with pytest.raises(CheckpointRejected, match=torn.name):
        _load(ck, key="")
