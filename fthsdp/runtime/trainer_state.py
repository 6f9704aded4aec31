"""The trainer's non-tensor state, which travels with the tensors (catch-up snapshots, checkpoints) and is covered
by the state digest: the optimizer's ``param_groups`` (lr, betas, weight_decay, ...; not their parameters) and
the ``state_dict()`` of every object the trainer registered (an LR scheduler, any other replicated stateful
object).

It is encoded as canonical JSON (sorted keys, no spaces), never pickled: the catch-up wire format is pickle-free
and a checkpoint must not run code when read. Types JSON lacks are tagged so that they come back as they were:
a tuple, a dict with a key that is not a string, bytes, a tensor (its raw bytes in base64). Anything else (a
function, an arbitrary object) cannot be encoded: ``register`` says so at once, naming where it is."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fthsdp.runtime.errors import StateMismatch

TAG = "__fthsdp__"
"""The key that marks a tagged value (a dict of the trainer's that has this key is itself encoded tagged)."""


class Stateful(Protocol):
    """What the runtime can carry: an object with ``state_dict()`` and ``load_state_dict()``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Scheduler(Stateful, Protocol):
    """An LR scheduler: stateful, and stepped once per committed optimizer step."""

    def step(self) -> None: ...


class UnencodableState(TypeError):
    """A registered object's state (or a param group's hyper-parameter) holds a value JSON cannot carry."""


def to_json(value: Any, where: str = "state") -> Any:
    """``value`` as JSON-able data, tagging the types JSON lacks; ``where`` names it in the error."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value  # repr round-trips exactly; NaN and infinities as Python's json writes them
    if isinstance(value, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {TAG: "dict", "v": [[to_json(k, f"{where} key {k!r}"), to_json(v, f"{where}[{k!r}]")]
                                   for k, v in value.items()]}
    if isinstance(value, bytes):
        return {TAG: "bytes", "b64": base64.b64encode(value).decode()}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "b64": base64.b64encode(raw).decode()}
    raise UnencodableState(f"{where} is a {type(value).__qualname__}, which fthsdp cannot carry as JSON (supported: "
                           "None, bool, int, float, str, list, tuple, dict, bytes, tensors)")


def from_json(doc: Any) -> Any:
    """The value ``to_json`` encoded."""
    if isinstance(doc, list):
        return [from_json(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    kind = doc.get(TAG)
    if kind is None:
        return {k: from_json(v) for k, v in doc.items()}
    if kind == "tuple":
        return tuple(from_json(v) for v in doc["v"])
    if kind == "dict":
        return {from_json(k): from_json(v) for k, v in doc["v"]}
    if kind == "bytes":
        return base64.b64decode(doc["b64"])
    if kind == "tensor":
        dtype = getattr(torch, str(doc["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise StateMismatch(f"unknown tensor dtype {doc['dtype']!r} in the trainer state")
        raw = bytearray(base64.b64decode(doc["b64"]))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(doc["shape"]).clone()
    raise StateMismatch(f"unknown tagged value {kind!r} in the trainer state")


def encode(value: Any) -> bytes:
    """Canonical JSON bytes of ``value``: equal values give equal bytes (the digest hashes them)."""
    return json.dumps(to_json(value), sort_keys=True, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    try:
        return from_json(json.loads(data))
    except (ValueError, KeyError, TypeError) as e:
        raise StateMismatch(f"the trainer state is not valid fthsdp JSON: {e}") from None


def param_groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyper-parameters per param group, without the parameters themselves."""
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]


@dataclass(frozen=True)
class Registered:
    """One registered object, and what to run after every committed optimizer step (None: nothing)."""

    obj: Stateful
    on_commit: Callable[[], object] | None


class TrainerState:
    """The objects a trainer registered, in registration order, and the optimizer whose param groups travel."""

    def __init__(self) -> None:
        self.objects: dict[str, Registered] = {}

    def register(self, name: str, obj: Stateful, on_commit: Callable[[], object] | None = None) -> None:
        """Carry ``obj``'s ``state_dict()`` under ``name``; ``on_commit`` (e.g. a scheduler's ``step``) runs after
        every committed optimizer step, replayed ones included. Checks now that its state can be encoded."""
        if not isinstance(name, str) or not name or name in self.objects:
            raise ValueError(f"state name {name!r} must be a non-empty string not registered yet "
                             f"(registered: {sorted(self.objects)})")
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"{name!r}: a {type(obj).__qualname__} has no state_dict()/load_state_dict()")
        to_json(obj.state_dict(), f"{name}.state_dict()")
        self.objects[name] = Registered(obj, on_commit)

    def encode(self, opt: torch.optim.Optimizer) -> bytes:
        """The param groups and every registered object's state, as canonical JSON."""
        return encode({"param_groups": param_groups(opt),
                       "objects": {name: r.obj.state_dict() for name, r in self.objects.items()}})

    def parse(self, opt: torch.optim.Optimizer, data: bytes) -> dict[str, Any]:
        """Decode what ``encode`` produced on another replica (or in a checkpoint) and check that it fits this
        replica (the same registered names, as many param groups), changing nothing."""
        doc = decode(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("objects"), dict) \
                or not isinstance(doc.get("param_groups"), list):
            raise StateMismatch("the trainer state lacks 'param_groups' or 'objects'")
        theirs = sorted(doc["objects"])
        if theirs != sorted(self.objects):
            raise StateMismatch(f"the source registered state {theirs}, this replica {sorted(self.objects)}: "
                                "every replica must register the same objects")
        if len(doc["param_groups"]) != len(opt.param_groups):
            raise StateMismatch(f"the source's optimizer has {len(doc['param_groups'])} param groups, this one "
                                f"{len(opt.param_groups)}")
        return doc

    def apply(self, opt: torch.optim.Optimizer, doc: dict[str, Any]) -> None:
        """Load a ``parse``d trainer state: the param groups' hyper-parameters, every registered object."""
        for group, theirs in zip(opt.param_groups, doc["param_groups"], strict=True):
            params = group["params"]
            group.clear()
            group.update(theirs, params=params)
        for name, r in self.objects.items():
            r.obj.load_state_dict(doc["objects"][name])

    def on_commit(self) -> None:
        """After a committed optimizer step: step what asked to be stepped (schedulers), in registration order."""
        for r in self.objects.values():
            if r.on_commit is not None:
                r.on_commit()
