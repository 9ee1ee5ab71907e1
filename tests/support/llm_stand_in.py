"""A stand-in LLM judge for the tests of the LLM judge offline (tests/answers/test_llm_judge.py) and online
(tests/stages/test_judge.py): an OpenAI-compatible completions route on 127.0.0.1 that answers each prompt with
`answer(prompt)` (by default `longer`: the slot of the longer answer) and records every request."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# the two answers in evaluate.llm_judge's default template
ANSWERS = re.compile(r"Answer 1: (?P<first>.*)\n\nAnswer 2: (?P<second>.*)\n\nThe better", re.S)


def longer(prompt: str) -> str:
    """A judge that prefers the longer answer, and the first slot when both are as long."""
    found = ANSWERS.search(prompt)
    return "2" if len(found["second"]) > len(found["first"]) else "1"


class StandIn:
    """POST /v1/completions answered by `answer(prompt)`; HTTP 500 for a prompt holding "FAIL". Records each
    request's body and Authorization header."""

    def __init__(self, answer=longer) -> None:
        self.seen: list[tuple[dict, str | None]] = []
        served = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                served.seen.append((request, self.headers.get("Authorization")))
                failed = "FAIL" in request["prompt"]
                body = b"{}" if failed else json.dumps({"choices": [{"text": answer(request["prompt"])}]}).encode()
                self.send_response(500 if failed else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # stop() in 0.05 s

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
