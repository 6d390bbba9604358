"""NATS nkeys: Ed25519 keys written as NATS writes them.

A public key is base32 (RFC 4648, no padding) of one prefix byte naming its
role (``A`` account, ``U`` user, ``N`` server, ...), the 32-byte Ed25519 public
key and a CRC-16 (XMODEM, little-endian) of the bytes before it. A seed packs
the seed marker ``S`` and the role into two bytes, then the 32-byte Ed25519
seed and the CRC. ``python -m gpuslice_common.nkeys`` prints a fresh account
key pair: the seed for the callout's secret, the public key for NATS's
``issuer``.
"""

from __future__ import annotations

import base64
import binascii
import enum
import sys
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

__all__ = ["KeyPair", "NkeyError", "Role", "public_role", "verify"]

_SEED_BYTE = 18 << 3  # 'S' as the first base32 character


class NkeyError(ValueError):
    """Not a valid nkey (or not of the expected role)."""


class Role(enum.IntEnum):
    """The prefix byte of each role: its first base32 character is the letter."""

    OPERATOR = 14 << 3  # O
    SERVER = 13 << 3  # N
    CLUSTER = 2 << 3  # C
    ACCOUNT = 0  # A
    USER = 20 << 3  # U


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM (polynomial 0x1021, initial value 0), as nkeys checks it."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _encode(raw: bytes) -> str:
    checked = raw + crc16(raw).to_bytes(2, "little")
    return base64.b32encode(checked).decode().rstrip("=")


def _decode(text: str) -> bytes:
    if not text or not text.isascii():
        raise NkeyError("not an nkey")
    try:
        data = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError):
        raise NkeyError("not an nkey: not base32") from None
    if len(data) < 3:
        raise NkeyError("not an nkey: too short")
    raw, crc = data[:-2], int.from_bytes(data[-2:], "little")
    if crc16(raw) != crc:
        raise NkeyError("not an nkey: checksum mismatch")
    return raw


def encode_public(role: Role, key: bytes) -> str:
    if len(key) != 32:
        raise NkeyError("an Ed25519 public key has 32 bytes")
    return _encode(bytes([role]) + key)


def decode_public(text: str, role: Role | None = None) -> tuple[Role, bytes]:
    """The role and the 32 key bytes of a public nkey (of ``role``, if given)."""
    raw = _decode(text)
    if len(raw) != 33:
        raise NkeyError("not a public nkey: wrong length")
    try:
        found = Role(raw[0])
    except ValueError:
        raise NkeyError("not a public nkey: unknown role") from None
    if role is not None and found != role:
        raise NkeyError(f"not a public {role.name.lower()} key")
    return found, raw[1:]


def public_role(text: str) -> Role | None:
    """The role of a valid public nkey, or None."""
    try:
        return decode_public(text)[0]
    except NkeyError:
        return None


def verify(public: str, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the public key's Ed25519 signature of ``message``."""
    try:
        _, key = decode_public(public)
        Ed25519PublicKey.from_public_bytes(key).verify(signature, message)
    except (NkeyError, InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class KeyPair:
    """An nkey with its private half: signs for its role."""

    role: Role
    private: Ed25519PrivateKey

    @classmethod
    def generate(cls, role: Role) -> KeyPair:
        return cls(role, Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: str, role: Role | None = None) -> KeyPair:
        """The key pair of an encoded seed (``S...``), of ``role`` if given."""
        raw = _decode(seed.strip())
        if len(raw) != 34 or raw[0] & 0xF8 != _SEED_BYTE:
            raise NkeyError("not an nkey seed")
        prefix = ((raw[0] & 0x07) << 5) | ((raw[1] & 0xF8) >> 3)
        try:
            found = Role(prefix)
        except ValueError:
            raise NkeyError("not an nkey seed: unknown role") from None
        if role is not None and found != role:
            raise NkeyError(f"not a {role.name.lower()} seed")
        return cls(found, Ed25519PrivateKey.from_private_bytes(raw[2:]))

    @property
    def raw_seed(self) -> bytes:
        return self.private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @property
    def seed(self) -> str:
        head = bytes([_SEED_BYTE | (self.role >> 5), (self.role & 0x1F) << 3])
        return _encode(head + self.raw_seed)

    @property
    def public_key(self) -> str:
        raw = self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return encode_public(self.role, raw)

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)


def main(argv: list[str]) -> int:
    """Print a fresh account key pair (seed, then public key), one per line."""
    if argv not in ([], ["account"]):
        print("usage: python -m gpuslice_common.nkeys [account]", file=sys.stderr)
        return 2
    pair = KeyPair.generate(Role.ACCOUNT)
    print(f"seed: {pair.seed}")
    print(f"public: {pair.public_key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
