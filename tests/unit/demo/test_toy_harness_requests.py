"""The toy harness's two calls, as a real HTTP endpoint receives them."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from openforge.toy import harness


def test_both_calls_offer_the_same_tools_so_the_second_prompt_can_extend_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[dict[str, Any]] = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "mid"}}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        monkeypatch.setenv("OPENFORGE_TOY_WORD", "dim")
        assert harness.main(["Find the secret word."]) == 0
    finally:
        server.shutdown()
        server.server_close()
    first, second = received
    assert first["tools"] == second["tools"] == [harness.SECRET_TOOL]
    assert second["messages"][:len(first["messages"])] == first["messages"]
    assert (tmp_path / harness.ANSWER_FILE).read_text() == "mid"
