"""The wire envelope every message shares, and the one codec that reads and writes it.

A message on the wire is a msgpack array `[kind, version, payload]`: `kind` names the model,
`version` is the payload schema's version, `payload` is the model's fields as a map. msgpack
rather than JSON because it is ~2x smaller and faster here (see docs/substrate.md for the
measurement) and carries bytes natively, so small tensors ride inline without base64.

Decoding never raises anything but `ProtocolError`: garbage, an unknown kind, a version this
build does not read, or a payload that fails validation. Callers log and dead-letter it.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound="Message")

_REGISTRY: dict[str, type[Message]] = {}


class ProtocolError(ValueError):
    """Bytes that are not a message this build can read; `kind` is set when the envelope parsed."""

    def __init__(self, reason: str, kind: str | None = None) -> None:
        super().__init__(reason if kind is None else f"{kind}: {reason}")
        self.reason = reason
        self.kind = kind


class Record(BaseModel):
    """A typed part of a message (no envelope of its own): frozen and strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Message(Record):
    """A top-level message: one `KIND` per class, and the `VERSION` of its payload schema.

    A class reads payloads from `MIN_VERSION` to `VERSION`; `upgrade` turns an older payload into
    the current shape. Bump `VERSION` on any change a reader of the old schema would misread.
    """

    KIND: ClassVar[str]
    VERSION: ClassVar[int] = 1
    MIN_VERSION: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("KIND")
        if kind is not None:
            if kind in _REGISTRY:
                raise TypeError(f"message kind {kind!r} is defined twice")
            _REGISTRY[kind] = cls

    @classmethod
    def upgrade(cls, version: int, payload: dict[str, Any]) -> dict[str, Any]:
        """Turn a payload of an older readable `version` into the current schema (identity at v1)."""
        return payload

    def to_bytes(self) -> bytes:
        """The wire bytes of this message (`decode` reads them back)."""
        return encode(self)


def encode(message: Message) -> bytes:
    """Serialise a message into its envelope."""
    payload = message.model_dump(mode="python", exclude_defaults=True)
    return msgpack.packb([message.KIND, message.VERSION, payload], use_bin_type=True)


def decode(data: bytes | bytearray | memoryview, expect: type[M] | tuple[type[M], ...] | None = None) -> M:
    """Parse and validate wire bytes; `expect` limits which kinds are acceptable on this subject.

    Raises `ProtocolError` for anything that is not a valid, readable message of an expected kind.
    """
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not (isinstance(envelope, list) and len(envelope) == 3):
        raise ProtocolError("envelope is not [kind, version, payload]")
    kind, version, payload = envelope
    if not isinstance(kind, str) or not isinstance(version, int) or not isinstance(payload, dict):
        raise ProtocolError("envelope fields have the wrong types")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ProtocolError("unknown message kind", kind)
    if expect is not None:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        if not issubclass(cls, allowed):
            raise ProtocolError(f"unexpected here (want {', '.join(c.KIND for c in allowed)})", kind)
    if not cls.MIN_VERSION <= version <= cls.VERSION:
        raise ProtocolError(f"version {version} not readable (reads {cls.MIN_VERSION}..{cls.VERSION})", kind)
    try:
        return cls.model_validate(cls.upgrade(version, payload))  # type: ignore[return-value]
    except ValidationError as exc:
        raise ProtocolError(
            f"invalid payload: {exc.error_count()} error(s): {_first_error(exc)}", kind
        ) from None


def message_kinds() -> dict[str, type[Message]]:
    """Every registered kind and its class (for tests and docs)."""
    return dict(_REGISTRY)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "payload"
    return f"{where}: {err.get('msg', '')}"
