"""The engine<->ranks messages are ``runtime.link.rank_protocol``'s: every ``wire.pack_message`` and
``wire.unpack_message`` site of the product names its types from there and packs the fields its
``MESSAGES`` entry lists (read with ``ast``, nothing run); and each message decodes where it is read."""

from __future__ import annotations

import ast
import pathlib

import pytest

from runtime.core.errors import ProtocolError, RemoteError
from runtime.link import rank_protocol as rp
from runtime.transport import wire

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: files whose sites may spell their message types as literals: none (every site names rank_protocol's)
LITERALS_STILL_ALLOWED: set[str] = set()
#: the sets a site may expect, by the name rank_protocol gives them
READ_SETS = {"INBOX": rp.INBOX, "CONTROL": rp.CONTROL, "ANSWERS": rp.ANSWERS, "BEATS": rp.BEATS}


def _sites(name: str):
    """(path, call) of every ``wire.<name>(...)`` call in the product code."""
    for package in ("runtime", "supervisor", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "wire"):
                    yield path.relative_to(ROOT).as_posix(), node


def _rp_name(node: ast.AST) -> str | None:
    """``X`` for ``rp.X`` or ``rank_protocol.X``; None otherwise."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr if node.value.id in ("rp", "rank_protocol") else None
    return None


def _message_type(path: str, node: ast.Call) -> str:
    first = node.args[0]
    name = _rp_name(first)
    if name is not None:
        return getattr(rp, name)
    assert path in LITERALS_STILL_ALLOWED and isinstance(first, ast.Constant), \
        f"{path}:{node.lineno}: the message type is not one of runtime.link.rank_protocol's"
    return first.value


def _fields(node: ast.Call) -> set[str]:
    fields = set()
    for keyword in node.keywords:
        if keyword.arg is None:  # **rp.error_fields(exc)
            call = keyword.value
            assert isinstance(call, ast.Call) and _rp_name(call.func) == "error_fields", ast.unparse(keyword)
            fields |= set(rp.ERROR_FIELDS)
        elif keyword.arg != "tensor_encoder":
            fields.add(keyword.arg)
    return fields


def test_every_pack_site_sends_a_message_of_the_table_with_its_fields():
    seen = set()
    for path, node in _sites("pack_message"):
        kind = _message_type(path, node)
        assert kind in rp.MESSAGES, f"{path}:{node.lineno}: {kind!r} is not a message of rank_protocol"
        message, fields = rp.MESSAGES[kind], _fields(node)
        assert set(message.required) <= fields <= message.fields, (path, node.lineno, kind, fields)
        seen.add(kind)
    assert seen == set(rp.MESSAGES), "a message of the table that nobody sends"


def test_every_unpack_site_expects_a_set_of_the_table():
    found = 0
    for path, node in _sites("unpack_message"):
        expected = [k.value for k in node.keywords if k.arg == "expected_types"]
        assert expected and _rp_name(expected[0]) in READ_SETS, f"{path}:{node.lineno}: {ast.unparse(node)}"
        found += 1
    assert found >= 5  # the rank's inbox and control messages, the engine's ctl and hb ROUTERs


def test_the_sets_follow_the_table():
    assert rp.INBOX == {rp.REQUEST, rp.BATCH, rp.CANCEL} and rp.CONTROL == {rp.FREE, rp.SHUTDOWN}
    assert rp.ANSWERS == {rp.READY, rp.STARTUP_ERROR, rp.DONE, rp.PARTIAL}
    assert rp.BEATS == {rp.HB}
    assert set(rp.MESSAGES) == rp.INBOX | rp.CONTROL | rp.ANSWERS | rp.BEATS


@pytest.mark.parametrize("kind", sorted(rp.MESSAGES))
def test_each_message_decodes_where_it_is_read_and_nowhere_else(kind):
    message = rp.MESSAGES[kind]
    data = wire.pack_message(kind, 1, **{field: [] for field in message.required})
    reads = [s for s in READ_SETS.values() if kind in s]
    assert len(reads) == 1  # each message is read at one place, heartbeats included
    for expected in READ_SETS.values():
        if kind in expected:
            assert wire.unpack_message(data, expected_types=expected)["type"] == kind
        else:
            with pytest.raises(ProtocolError, match="unexpected message type"):
                wire.unpack_message(data, expected_types=expected)


def test_a_ranks_error_comes_back_as_the_remote_error_it_reported():
    try:
        raise KeyError("missing")
    except KeyError as exc:
        fields = rp.error_fields(exc)
    assert set(fields) == set(rp.ERROR_FIELDS)
    msg = wire.unpack_message(wire.pack_message(rp.DONE, 3, ok=False, **fields), expected_types=rp.ANSWERS)
    error = rp.remote_error(msg)
    assert isinstance(error, RemoteError) and error.remote_type == "KeyError"
    assert error.remote_message == "'missing'" and "raise KeyError" in error.remote_traceback
