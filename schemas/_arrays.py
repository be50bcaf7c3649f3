"""Packed numeric arrays for token-level event fields.

A model call with a 100k-token prompt would be about a megabyte of JSON as a list of numbers, and
pydantic would validate every element on the way in. These types keep the values as one packed
little-endian buffer instead: in JSON they are a single base64 string (standard alphabet, padded),
and decoding is one base64 decode plus a zero-copy view, so a 100k-token array goes through JSON
in a few milliseconds with no per-element Python work. Floats are stored as float64 because vLLM
reports logprobs as JSON doubles; keeping all 64 bits makes the recorded behaviour logprobs
bit-exact, NaN payloads and negative zero included.

In Python the values behave as immutable sequences (``len``, iteration, indexing, slicing,
``tolist``). Two arrays of the same kind are equal when their packed bytes are equal: that is the
identity of a recorded value, so ``NaN`` equals the same ``NaN`` and ``-0.0`` differs from ``0.0``.
They also compare equal to a list or tuple holding the same values, which keeps tests and callers
short; the hash follows the bytes, so do not mix arrays and tuples as keys of one dict.

Accepted inputs when validating a field: an instance of the same kind, a base64 string of the
packed little-endian bytes, or a list, tuple, ``range`` or ``array.array`` of numbers.
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar, overload

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

__all__ = ["Logprobs", "LossMask", "PackedArray", "RawBytes", "TokenIds"]

_T = TypeVar("_T", int, float)

_LITTLE_ENDIAN_HOST = sys.byteorder == "little"
_INT32_MAX = 2**31 - 1

# The packed formats are fixed by the wire contract, not by the host's C types; fail loudly at
# import on a platform where the array typecodes have other sizes rather than corrupt data.
if array("i").itemsize != 4 or array("d").itemsize != 8 or array("B").itemsize != 1:
    raise ImportError("packed arrays need 4-byte 'i', 8-byte 'd' and 1-byte 'B' array typecodes")

_BASE64_PATTERN = r"^[A-Za-z0-9+/]*={0,2}$"


class PackedArray(Sequence[_T]):
    """Immutable sequence of fixed-size numbers stored as little-endian bytes.

    Subclasses fix the element format. The packed bytes are kept as an immutable ``bytes``
    object so that encoding, hashing and comparing never copy element by element, and decoding
    from base64 needs no per-element Python work at all.
    """

    __slots__ = ("_data", "_view")

    _TYPECODE: ClassVar[Literal["i", "d", "B"]]
    """``array``/``memoryview`` format code of one element in host byte order."""
    _ITEM_SIZE: ClassVar[int]
    """Bytes per element on the wire."""
    _DTYPE: ClassVar[str]
    """Wire format in NumPy notation, for readers in other languages and the JSON Schema."""
    _ITEM_NAME: ClassVar[str]
    """Short name of the element format (``int32``), used in messages and the JSON Schema."""
    _KIND: ClassVar[str]
    """What each element must be, used in error messages."""

    _data: bytes
    _view: memoryview[Any]

    def __init__(self, values: Iterable[_T] = ()) -> None:
        """Pack values, checking each against the element format.

        Args:
            values: Numbers to pack. Lists, tuples, ``range`` and ``array.array`` are packed in
                C without a per-element Python loop.

        Raises:
            ValueError: A value does not fit the element format (see the subclass).
        """
        if isinstance(values, PackedArray):
            if not isinstance(values, type(self)):
                raise ValueError(f"cannot build {type(self).__name__} from {type(values).__name__}")
            self._set(values._data)
            return
        self._set(self._pack(values))
        self._check()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Self:
        """Build from packed little-endian bytes, as written by :meth:`to_bytes`.

        Raises:
            ValueError: The length is not a whole number of elements, or an element is invalid.
        """
        raw = bytes(data)
        if len(raw) % cls._ITEM_SIZE:
            raise ValueError(
                f"{cls.__name__}: {len(raw)} bytes is not a whole number of "
                f"{cls._ITEM_SIZE}-byte {cls._ITEM_NAME} items"
            )
        return cls._checked(raw)

    @classmethod
    def from_base64(cls, text: str | bytes) -> Self:
        """Build from the standard-alphabet base64 of the packed little-endian bytes.

        Raises:
            ValueError: The text is not valid base64, or the decoded length is not a whole
                number of elements, or an element is invalid.
        """
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{cls.__name__}: not valid base64 ({exc})") from None
        if len(raw) % cls._ITEM_SIZE:
            raise ValueError(
                f"{cls.__name__}: base64 decodes to {len(raw)} bytes, which is not a whole "
                f"number of {cls._ITEM_SIZE}-byte {cls._ITEM_NAME} items"
            )
        return cls._checked(raw)

    @classmethod
    def concat(cls, parts: Iterable[Self]) -> Self:
        """Join arrays of this kind end to end without unpacking them."""
        chunks: list[bytes] = []
        for part in parts:
            if not isinstance(part, cls):
                raise ValueError(f"cannot concatenate {type(part).__name__} into {cls.__name__}")
            chunks.append(part._data)
        return cls._unchecked(b"".join(chunks))

    # -- export -------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Return the packed little-endian bytes (shared, immutable; no copy is made)."""
        return self._data

    def to_base64(self) -> str:
        """Return the JSON wire form: standard-alphabet, padded base64 of :meth:`to_bytes`."""
        return base64.b64encode(self._data).decode("ascii")

    def tolist(self) -> list[_T]:
        """Return the values as a new list of Python numbers."""
        # memoryview.tolist() yields floats for the 'd' format; typeshed only knows ints.
        values: list[Any] = self._view.tolist()
        return values

    @property
    def nbytes(self) -> int:
        """Size of the packed data in bytes."""
        return len(self._data)

    # -- sequence protocol --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, index: int) -> _T: ...

    @overload
    def __getitem__(self, index: slice) -> Self: ...

    def __getitem__(self, index: int | slice) -> _T | Self:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                size = self._ITEM_SIZE
                return self._unchecked(self._data[start * size : max(start, stop) * size])
            return self._from_native(array(self._TYPECODE, self._view[index].tolist()))
        item: _T = self._view[index]
        return item

    def __iter__(self) -> Iterator[_T]:
        return iter(self._view)

    def __contains__(self, value: object) -> bool:
        return value in self._view

    def __bool__(self) -> bool:
        return bool(self._data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            return type(other) is type(self) and other._data == self._data
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self._view.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._data))

    def __repr__(self) -> str:
        count = len(self)
        if count <= 8:
            return f"{type(self).__name__}({self._view.tolist()!r})"
        head = ", ".join(repr(v) for v in self._view[:4].tolist())
        tail = ", ".join(repr(v) for v in self._view[-2:].tolist())
        return f"{type(self).__name__}([{head}, ..., {tail}], len={count})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_bytes, (self._data,))

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self

    # -- internals ----------------------------------------------------------------------------

    def _set(self, data: bytes) -> None:
        self._data = data
        if _LITTLE_ENDIAN_HOST:
            self._view = memoryview(data).cast(self._TYPECODE)
        else:  # pragma: no cover - no big-endian hosts in CI
            native = array(self._TYPECODE)
            native.frombytes(data)
            native.byteswap()
            self._view = memoryview(native.tobytes()).cast(self._TYPECODE)

    @classmethod
    def _unchecked(cls, data: bytes) -> Self:
        obj = cls.__new__(cls)
        obj._set(data)
        return obj

    @classmethod
    def _checked(cls, data: bytes) -> Self:
        obj = cls._unchecked(data)
        obj._check()
        return obj

    @classmethod
    def _from_native(cls, values: array[Any]) -> Self:
        if not _LITTLE_ENDIAN_HOST:  # pragma: no cover - no big-endian hosts in CI
            values = array(values.typecode, values)
            values.byteswap()
        return cls._unchecked(values.tobytes())

    @classmethod
    def _pack(cls, values: Iterable[_T]) -> bytes:
        """The little-endian bytes of ``values``, not yet checked (see :meth:`_check`)."""
        if isinstance(values, str | bytes | bytearray | memoryview):
            # bytes would otherwise pack as small integers, and a str is only meaningful as
            # base64, which has its own constructor.
            raise ValueError(f"{cls.__name__} takes numbers; use from_bytes()/from_base64() for packed data")
        if type(values) is list or type(values) is tuple:
            # struct packs a list in about half the time array() takes (which converts item by
            # item through a generic setter), and writes little-endian on any host. On a value
            # it refuses, the array path below runs and says which value is wrong.
            try:
                data = struct.pack(f"<{len(values)}{cls._TYPECODE}", *values)
            except (struct.error, OverflowError, TypeError):
                pass
            else:
                return data
        try:
            packed = array(cls._TYPECODE, values)
        except OverflowError:
            raise ValueError(cls._describe_first_invalid(values)) from None
        except TypeError as exc:
            raise ValueError(f"{cls.__name__}: every item must be {cls._KIND} ({exc})") from None
        return cls._from_native(packed)._data

    def _check(self) -> None:
        """Reject elements the packed format can hold but the field does not allow."""

    @classmethod
    def _describe_first_invalid(cls, values: Iterable[Any]) -> str:
        return f"{cls.__name__}: every item must be {cls._KIND}"

    # -- pydantic integration -----------------------------------------------------------------

    @classmethod
    def __get_pydantic_core_schema__(cls, source_type: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._pydantic_validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                cls.to_base64, when_used="json", return_schema=core_schema.str_schema()
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        description = (
            f"Packed {cls.__name__}: standard base64 (padded) of consecutive {cls._ITEM_NAME} "
            f"values, little-endian ({cls._DTYPE} in NumPy notation)."
        )
        # A field's own description replaces the type's; the format also goes in $comment,
        # which survives, so a reader of any field still learns how to unpack it.
        return {
            "type": "string",
            "contentEncoding": "base64",
            "contentMediaType": "application/octet-stream",
            "pattern": _BASE64_PATTERN,
            "x-packed-dtype": cls._DTYPE,
            "description": description,
            "$comment": description,
        }

    @classmethod
    def _pydantic_validate(cls, value: Any) -> Self:
        if isinstance(value, cls):
            return value
        try:
            if isinstance(value, str):
                return cls.from_base64(value)
            if isinstance(value, list | tuple | range | array) and not isinstance(value, PackedArray):
                return cls(value)
        except ValueError as exc:
            raise PydanticCustomError("packed_array_invalid", "{detail}", {"detail": str(exc)}) from None
        raise PydanticCustomError(
            "packed_array_type",
            "{name} expects a base64 string or a list of numbers, got {got}",
            {"name": cls.__name__, "got": type(value).__name__},
        )


class TokenIds(PackedArray[int]):
    """Token ids as the engine saw or sampled them: non-negative int32, little-endian.

    int32 covers every vocabulary in use (the largest are a few hundred thousand entries) at
    half the size of int64, and matches the dtype most tokenizers and NumPy readers expect.
    """

    __slots__ = ()
    _TYPECODE = "i"
    _ITEM_SIZE = 4
    _DTYPE = "<i4"
    _ITEM_NAME = "int32"
    _KIND = "a non-negative int32"

    def _check(self) -> None:
        # The sign bit of each little-endian int32 lives in its fourth byte: the ids are all
        # non-negative exactly when every fourth byte is below 0x80, i.e. ASCII. Checking that on
        # a strided slice stays in C for 100k ids.
        if not self._data[3::4].isascii():
            raise ValueError(self._describe_first_invalid(self._view))

    @classmethod
    def _describe_first_invalid(cls, values: Iterable[Any]) -> str:
        for index, value in enumerate(values):
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value < 0:
                return f"TokenIds: token id {value} at index {index} is negative"
            if value > _INT32_MAX:
                return f"TokenIds: token id {value} at index {index} is out of int32 range (0..{_INT32_MAX})"
        return f"TokenIds: a token id is out of int32 range (0..{_INT32_MAX})"


class Logprobs(PackedArray[float]):
    """Log-probabilities as IEEE 754 float64, little-endian, bit-exact.

    No range check: the point is to record what the engine returned, and ``-inf`` for an
    impossible token, NaN from a broken kernel or a positive value from a bug are exactly what a
    later investigation needs to see unchanged.
    """

    __slots__ = ()
    _TYPECODE = "d"
    _ITEM_SIZE = 8
    _DTYPE = "<f8"
    _ITEM_NAME = "float64"
    _KIND = "a float"


class LossMask(PackedArray[int]):
    """Per-token training mask: one byte per token, 0 (not trained) or 1 (trained).

    One byte per token instead of a bit keeps the mask indexable and slicable with the same
    offsets as the token ids, lets readers map it straight onto a uint8/bool tensor, and costs
    little next to the ids (4 bytes) and logprobs (8 bytes) of the same tokens. Long runs of
    equal bytes also compress well in the transport.
    """

    __slots__ = ()
    _TYPECODE = "B"
    _ITEM_SIZE = 1
    _DTYPE = "|u1"
    _ITEM_NAME = "uint8"
    _KIND = "0 or 1"

    def _check(self) -> None:
        if self._data.translate(None, b"\x00\x01"):
            raise ValueError(self._describe_first_invalid(self._view))

    @classmethod
    def _describe_first_invalid(cls, values: Iterable[Any]) -> str:
        for index, value in enumerate(values):
            if value not in (0, 1):
                return f"LossMask: value {value!r} at index {index} is not 0 or 1"
        return "LossMask: every value must be 0 or 1"

    def count_trained(self) -> int:
        """Number of tokens with mask 1, counted in C."""
        return self._data.count(1)


def _raw_bytes_validate(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise PydanticCustomError(
                "raw_bytes_base64", "not valid base64 ({detail})", {"detail": str(exc)}
            ) from None
    raise PydanticCustomError(
        "raw_bytes_type",
        "expected bytes or a base64 string, got {got}",
        {"got": type(value).__name__},
    )


def _raw_bytes_serialize(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


class _RawBytesAnnotation:
    """Pydantic glue for :data:`RawBytes` (kept off ``bytes`` itself, which is not ours)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source_type: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(
            _raw_bytes_validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                _raw_bytes_serialize, when_used="json", return_schema=core_schema.str_schema()
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "type": "string",
            "contentEncoding": "base64",
            "contentMediaType": "application/octet-stream",
            "pattern": _BASE64_PATTERN,
            "description": "Arbitrary bytes as standard base64 (padded).",
        }


RawBytes = Annotated[bytes, _RawBytesAnnotation]
"""Opaque bytes (for example a Kafka key or value that could not be decoded).

In Python the value is plain ``bytes``; a ``str`` given to the field is read as base64 (that is
how JSON carries it), so pass raw data as ``bytes``, never as text.
"""
