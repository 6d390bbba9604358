"""nkeys and NATS JWTs as written here; the real nats-server judges them in
tests/deploy/test_identities.py (a user it accepts or refuses)."""

from __future__ import annotations

import base64

import pytest

from gpuslice_common import natsjwt
from gpuslice_common.nkeys import KeyPair, NkeyError, Role, crc16, decode_public, main
from gpuslice_inventory.authcallout import _jwt_claims


def test_crc16_is_xmodem() -> None:
    assert crc16(b"123456789") == 0x31C3


@pytest.mark.parametrize("role", list(Role))
def test_keys_of_each_role_round_trip_and_start_with_their_letter(role: Role) -> None:
    pair = KeyPair.generate(role)
    letter = {Role.OPERATOR: "O", Role.SERVER: "N", Role.CLUSTER: "C"}.get(role, role.name[0])
    assert pair.public_key[0] == letter
    assert pair.seed[:2] == f"S{letter}"
    again = KeyPair.from_seed(pair.seed, role)
    assert again.public_key == pair.public_key
    assert decode_public(pair.public_key, role)[0] == role


def test_a_changed_character_or_another_role_is_refused() -> None:
    pair = KeyPair.generate(Role.ACCOUNT)
    changed = (
        pair.public_key[:10] + ("A" if pair.public_key[10] != "A" else "B") + pair.public_key[11:]
    )
    with pytest.raises(NkeyError):
        decode_public(changed)
    with pytest.raises(NkeyError):
        decode_public(pair.public_key, Role.USER)
    with pytest.raises(NkeyError):
        KeyPair.from_seed(pair.seed, Role.USER)
    with pytest.raises(NkeyError):
        KeyPair.from_seed(pair.public_key)


def test_jwts_verify_with_their_issuer_only() -> None:
    account = KeyPair.generate(Role.ACCOUNT)
    user = KeyPair.generate(Role.USER)
    claims = natsjwt.user_claims(user.public_key, "GPUSLICE", "n", publish=["a"], subscribe=[])
    token = natsjwt.encode(claims, account)
    decoded = natsjwt.decode(token, Role.ACCOUNT)
    assert decoded["iss"] == account.public_key
    assert decoded["nats"]["sub"] == {"deny": [">"]}
    with pytest.raises(natsjwt.JwtError, match="issuer is not a server key"):
        natsjwt.decode(token, Role.SERVER)
    head, _, sig = token.split(".")
    other = natsjwt.encode(dict(claims, name="other"), account).split(".")[1]
    with pytest.raises(natsjwt.JwtError, match="bad signature"):
        natsjwt.decode(f"{head}.{other}.{sig}")
    expired = natsjwt.encode(dict(claims, exp=1), account)
    with pytest.raises(natsjwt.JwtError, match="expired"):
        natsjwt.decode(expired)


def test_the_module_prints_an_account_key_pair(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    seed_line, public_line = capsys.readouterr().out.splitlines()
    pair = KeyPair.from_seed(seed_line.removeprefix("seed: "), Role.ACCOUNT)
    assert public_line == f"public: {pair.public_key}"


def test_a_token_nested_too_deep_to_parse_is_no_jwt() -> None:
    """A client's token is read before anything is checked: JSON nested thousands
    deep must be refused as unreadable, not raise (and log a traceback)."""
    deep = base64.urlsafe_b64encode(b"[" * 5000).decode().rstrip("=")
    assert _jwt_claims(f"{deep}.{deep}.c2ln") is None
