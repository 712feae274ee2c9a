"""nbkit.remote: URLs resolved once, unreachable endpoints named at once."""

import socket
from types import SimpleNamespace

import pytest

from nbkit.remote import (connection_errors, endpoint_of, is_connection_error, is_local, network_errors,
                          remote_sizes, url_to_fs, write_bytes)


def test_url_to_fs_and_small_objects(tmp_path):
    fs, root = url_to_fs(f"{tmp_path}/")
    assert is_local(fs) and root == str(tmp_path) and endpoint_of(fs) is None
    fs, root = url_to_fs("memory://nbkit-remote-test/x")
    write_bytes(fs, f"{root}/a", b"abc")
    assert remote_sizes(fs, root) == {"a": 3} and remote_sizes(fs, root + "/nothing") == {}


def test_unreachable_endpoint_fails_at_once_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    fs = SimpleNamespace(protocol="s3", endpoint_url=f"http://127.0.0.1:{port}")  # what endpoint_of reads
    with pytest.raises(OSError, match=rf"could not reach the endpoint http://127.0.0.1:{port} while reading memory://x .*rerun"):
        with network_errors(fs, "memory://x", "reading", "rerun"):
            pass


def test_connection_errors_inside_the_block_are_named():
    fs, _ = url_to_fs("memory://x")
    assert is_connection_error(ConnectionResetError()) and not is_connection_error(FileNotFoundError())
    assert ConnectionError in connection_errors()
    with pytest.raises(OSError, match="could not reach the storage backend while pushing to memory://x"):
        with network_errors(fs, "memory://x", "pushing to", "rerun"):
            raise ConnectionResetError("gone")

