"""A registered version served here by transformers, as `kubealign serve` serves it by vLLM: for the feedback
rounds' rehearsal (benchmarks/feedback_rounds.py) and the rounds tier, where a vLLM CPU server would take 40-100 s
a start for each of two models a round.

It answers the routes the online judge asks (kubealign.serving.ask, identity): GET /v1/models lists the served
name and the version's MLflow model URI with one root (as `kubealign serve` names a version), POST
/v1/completions decodes greedily (temperature 0 is the judge's only request) from the prompt's tokens with the
BOS the tokenizer adds, as vLLM's completions route does, and says finish_reason "stop" when the model ended the
answer with its EOS, "length" when max_tokens cut it. No /metrics: the judge then has the client's latencies.
One request at a time (the model is not shared between threads).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubealign.serving.identity import version_name


class Served:
    """with Served(model_dir, registered, version) as s: s.url answers as `kubealign serve` would."""

    def __init__(self, model_dir: Path, registered: str, version: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        names = (registered, version_name(registered, version))
        self.listing = {"object": "list", "data": [{"id": n, "object": "model", "root": str(model_dir)} for n in names]}
        self.lock, self.requests = threading.Lock(), 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        import torch

        ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        eos = self.tokenizer.eos_token_id
        with self.lock, torch.no_grad():
            self.requests += 1
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id,
            )[0, ids.shape[1] :].tolist()
        ended = eos in out
        if ended:
            out = out[: out.index(eos)]
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        return {"text": text, "finish_reason": "stop" if ended else "length"}

    def __enter__(self) -> Served:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def handler(served: Served) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def send(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/v1/models":
                return self.send(200, served.listing)
            self.send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            names = {m["id"] for m in served.listing["data"]}
            if self.path != "/v1/completions" or request.get("model") not in names:
                return self.send(404, {"error": f"no model {request.get('model')!r} at {self.path}"})
            choice = served.complete(request["prompt"], int(request.get("max_tokens", 16)))
            self.send(200, {"object": "text_completion", "model": request["model"], "choices": [choice]})

    return Handler
