"""nbkit.transfer.remote: URLs resolved once; connect() fails within seconds, saying what happened, against real
loopback servers (the GCS emulator, a port that refuses, one that accepts and never answers, an HTTP
server that answers 401/403, a silent metadata server)."""

import threading

import pytest

from fixtures_gcs import (BlackHole, black_hole, gcs, gcs_server, refused_port, silent_metadata,
                          status_server)
from nbkit.transfer import remote
from nbkit.transfer.remote import (Stopped, check_bucket, classify, connect, connection_errors, endpoint_of, is_connection_error,
                          is_local, remote_errors, remote_sizes, url_to_fs, write_bytes)

ANON = {"token": "anon", "project": "test"}


def test_url_to_fs_and_small_objects(tmp_path):
    fs, root = url_to_fs(f"{tmp_path}/")
    assert is_local(fs) and root == str(tmp_path) and endpoint_of(fs) is None
    fs, root = url_to_fs("memory://nbkit-remote-test/x")
    write_bytes(fs, f"{root}/a", b"abc")
    assert remote_sizes(fs, root) == {"a": 3} and remote_sizes(fs, root + "/nothing") == {}


def test_connection_errors_inside_the_block_are_named():
    fs, _ = url_to_fs("memory://x")
    assert is_connection_error(ConnectionResetError()) and not is_connection_error(FileNotFoundError())
    assert ConnectionError in connection_errors()
    with pytest.raises(OSError, match=r"^cannot reach the storage backend \(ConnectionResetError: gone\)\nwhile pushing to memory://x\."):
        with remote_errors(fs, "memory://x", "pushing to", "rerun"):
            raise ConnectionResetError("gone")
    with pytest.raises(FileNotFoundError, match="^nothing$"):  # an error of another kind passes unchanged
        with remote_errors(fs, "memory://x", "pushing to", lambda: "rerun"):
            raise FileNotFoundError("nothing")


@pytest.mark.parametrize("url", ["gs://", "gs:///cache", "GS://", "s3://"])
def test_a_url_without_a_bucket_is_refused_before_any_network(url):
    with pytest.raises(ValueError, match=r"^no bucket in the URL"):
        check_bucket(url, "url")


@pytest.mark.parametrize("url", ["gs://b", "gs://b/c", "memory://", "/tmp/x", "file:///tmp/x"])
def test_urls_with_a_bucket_or_none_needed_pass(url):
    assert check_bucket(url, "url") == url


def lines(e):
    return str(e).splitlines()


def test_an_endpoint_that_never_answers_fails_within_seconds(black_hole, monkeypatch):
    monkeypatch.setattr(remote, "ANSWER_SECONDS", 1.0)
    so = dict(ANON, endpoint_url=f"http://{black_hole.address}")
    with pytest.raises(OSError, match=rf"^cannot reach the endpoint {black_hole.address} \(it accepted the connection "
                                      r"but did not answer within 1 s\)\n") as err:
        connect("gs://nbkit-b/c", so, doing="pushing to", fix="rerun it", write=True)
    assert lines(err.value)[1:] == [
        "while pushing to gs://nbkit-b/c.",
        "Check the URL, storage_options['endpoint_url'] or STORAGE_EMULATOR_HOST, and the network (proxy, VPN, "
        "firewall); then rerun it."]


def test_a_refused_port_fails_at_once(refused_port):
    so = dict(ANON, endpoint_url=f"http://127.0.0.1:{refused_port}")
    with pytest.raises(OSError, match=rf"^cannot reach the endpoint 127.0.0.1:{refused_port} \(connection refused\)\n") as err:
        connect("gs://nbkit-b/c", so, doing="pulling from", fix="rerun")
    assert isinstance(err.value.__cause__, ConnectionRefusedError)  # from the TCP probe, before gcsfs's retries


def test_a_missing_bucket_is_named(gcs_server):
    with pytest.raises(FileNotFoundError, match=rf"^the bucket 'nbkit-no-such-bucket' does not exist at 127.0.0.1:"
                                                rf"{gcs_server.port}\n"):
        connect("gs://nbkit-no-such-bucket/c", gcs_server.storage_options, doing="pushing to", fix="rerun", write=True)


def test_an_existing_bucket_connects(gcs):
    fs, root = connect(f"{gcs.url}/c", gcs.storage_options, doing="pushing to", fix="rerun", write=True)
    assert root == f"{gcs.name}/c" and fs.ls(gcs.name) == []


def test_401_says_no_credentials_and_403_permission_denied(status_server):
    refused = status_server(401, "Anonymous caller does not have storage.objects.list access to the bucket.")
    with pytest.raises(PermissionError, match=r"^no credentials for gs://nbkit-b/c \(the server refused anonymous "
                                              r"access\)\n.*\nTo fix: run `from google\.colab import auth; "
                                              r"auth\.authenticate_user\(\)` .*gcloud auth application-default login"):
        connect("gs://nbkit-b/c", dict(ANON, endpoint_url=refused.endpoint), doing="pulling from", fix="rerun")
    denied = status_server(403, "someone@example.com does not have storage.objects.list access to the bucket.")
    with pytest.raises(PermissionError, match=r"^permission denied on gs://nbkit-b/c \(someone@example\.com does not "
                                              r"have storage\.objects\.list access to the bucket\.\)\n"):
        connect("gs://nbkit-b/c", dict(ANON, endpoint_url=denied.endpoint), doing="pushing to", fix="rerun", write=True)


def test_no_credentials_fail_within_seconds_and_send_nothing(silent_metadata, gcs, monkeypatch):
    monkeypatch.setattr(remote, "CREDENTIALS_SECONDS", 1.0)
    so = {"endpoint_url": gcs.emulator.endpoint, "project": "test"}  # no token: look for one
    with pytest.raises(PermissionError, match=r"^no credentials for gs://.* \(none found within 1 s\)\n.*nothing was "
                                              r"sent\.\nTo fix: run `from google\.colab import auth; auth\.authenticate_"
                                              r"user\(\)` .*storage_options=\{'token': \.\.\.\}"):
        connect(f"{gcs.url}/c", so, doing="pushing to", fix="rerun", write=True)
    # A read may go on anonymously (a public bucket needs no credentials).
    fs, root = connect(f"{gcs.url}/c", so, doing="pulling from", fix="rerun")
    assert fs.ls(gcs.name) == []


@pytest.mark.parametrize("waiting_for", ["credentials", "the first answer"])
def test_stop_ends_the_wait(waiting_for, silent_metadata, black_hole, monkeypatch):
    """Stop reaches connect() while it waits for a silent metadata server or a silent endpoint."""
    monkeypatch.setattr(remote, "CREDENTIALS_SECONDS", 300.0)
    monkeypatch.setattr(remote, "ANSWER_SECONDS", 300.0)
    so = {"endpoint_url": f"http://{black_hole.address}", "project": "test"}
    if waiting_for == "the first answer":
        so["token"] = "anon"
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    outcome = []

    def run():
        try:
            connect("gs://nbkit-b/c", so, doing="pushing to", fix="rerun", write=True, should_stop=stop.is_set)
        except Stopped:
            outcome.append("stopped")
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=60)  # generous: without Stop the wait is 300 s
    assert outcome == ["stopped"]


def test_classify_leaves_other_errors_alone():
    assert classify(ValueError("bad"), None, "gs://b/c", "pushing to", "rerun") is None
    assert classify(PermissionError(13, "denied", "/local/file"), None, "gs://b/c", "pushing to", "rerun") is None
    e = classify(TimeoutError(), None, "gs://b/c", "pulling from", "rerun", note=" (downloading index.bin)")
    assert lines(e)[:2] == ["cannot reach the storage backend (no answer in time)",
                            "while pulling from gs://b/c (downloading index.bin)."]


def test_no_credentials_found_and_credentials_that_cannot_be_used_are_told_apart(silent_metadata, refused_port,
                                                                                  tmp_path, monkeypatch):
    import json

    from google.auth.compute_engine import _metadata

    so = {"endpoint_url": f"http://127.0.0.1:{refused_port}"}
    monkeypatch.setattr(_metadata, "_NO_GCE_CHECK", True)  # not on GCE: google-auth says "none" at once
    with pytest.raises(PermissionError, match=r"^no credentials for gs://nbkit-b/c \(none found\)\n"):
        connect("gs://nbkit-b/c", so, doing="pushing to", fix="rerun", write=True)
    # A signed-in user whose token cannot be refreshed (here: the token endpoint refuses).
    adc = tmp_path / "adc.json"
    adc.write_text(json.dumps({"type": "authorized_user", "client_id": "id", "client_secret": "secret",
                               "refresh_token": "refresh", "token_uri": f"http://127.0.0.1:{refused_port}/token"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    with pytest.raises(PermissionError, match=r"^no credentials for gs://nbkit-b/c \(the ones found could not be used: "
                                              r"\w+Error: "):
        connect("gs://nbkit-b/c", so, doing="pushing to", fix="rerun", write=True)
