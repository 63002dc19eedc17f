"""A config from a URL or a file is read up to MAX_CONFIG_BYTES, never more: one line naming --config instead."""

import contextlib
import json
import threading
from collections.abc import Iterator

import pytest

import arguments
from arguments import MAX_CONFIG_BYTES, load_config
from collab.errors import ConfigError
from tests.http_server import QuietHandler, serving

pytestmark = pytest.mark.light

SMALL = {"target_batch_size": 128}


@contextlib.contextmanager
def config_server() -> Iterator[str]:
    """GET /small: a config; /declared-huge: a Content-Length past the cap; /endless: bytes until the client stops
    reading, with no Content-Length; /slow: a valid config a few bytes at a time."""

    class Handler(QuietHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if self.path == "/declared-huge":
                self.send_header("Content-Length", str(10 * MAX_CONFIG_BYTES))
            if self.path == "/small":
                body = json.dumps(SMALL).encode()
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.end_headers()
            chunk = b" " * 4096 if self.path != "/slow" else b" "
            with contextlib.suppress(OSError):  # the client hangs up once it has read enough
                for _ in range(3 * MAX_CONFIG_BYTES // len(chunk)):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    if self.path == "/slow":
                        stop.wait(0.05)

    stop = threading.Event()
    Handler.protocol_version = "HTTP/1.0"  # no Content-Length: the body ends when the connection closes
    with serving(Handler) as url:
        try:
            yield url
        finally:
            stop.set()


def test_a_config_url_is_read_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(arguments, "CONFIG_DOWNLOAD_TIMEOUT", 0.5)
    with config_server() as url:
        assert load_config(url + "/small") == SMALL
        for path in ("/declared-huge", "/endless"):
            with pytest.raises(ConfigError, match=rf"^--config: {url}{path} is larger than {MAX_CONFIG_BYTES} bytes"):
                load_config(url + path)
        with pytest.raises(ConfigError, match=rf"^--config: {url}/slow took more than 0 s") as error:
            load_config(url + "/slow")
    assert "\n" not in str(error.value)


def test_a_config_file_is_read_up_to_the_cap(tmp_path):
    at_the_cap = tmp_path / "at.json"
    at_the_cap.write_bytes(json.dumps(SMALL).encode().ljust(MAX_CONFIG_BYTES))
    assert load_config(str(at_the_cap)) == SMALL
    past_the_cap = tmp_path / "past.json"
    past_the_cap.write_bytes(json.dumps(SMALL).encode().ljust(MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=rf"^--config: {past_the_cap} is larger than {MAX_CONFIG_BYTES} bytes"):
        load_config(str(past_the_cap))
    with pytest.raises(ConfigError, match="^--config: .* is larger than"):
        load_config("/dev/zero")
