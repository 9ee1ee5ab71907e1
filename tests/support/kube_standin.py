"""A stand-in of the Kubernetes API for InferenceServices on 127.0.0.1 (no cluster here).

It answers the real `kubernetes` client's GET / POST / PATCH (merge patch) of
/apis/serving.kserve.io/v1beta1/namespaces/NS/inferenceservices[/NAME], keeps the objects with a
resourceVersion and a generation (bumped when the spec changes), checks every object it stores against the
KServe v0.20.0 CRD schema (a violation is a 422, as a strict API server with that CRD would answer), and
refuses a patch whose resourceVersion is stale (409). `fail` injects an answer: {(method, call number): status}.
`ready_after` GETs after a generation appears, the controller "reconciles" it: status.observedGeneration and
a Ready condition (True, or `not_ready_message` forever when ready_after is None).

Pods (GET /api/v1/namespaces/NS/pods?labelSelector=a=b,c=d): one Running, Ready pod per predictor of each
InferenceService there (the stable one and each canary), carrying the predictor's `labels` as KServe copies
them, at 127.0.0.1 with its model container's port from `ports` (role label value -> port).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.k8s_schemas import errors

PATH = re.compile(r"^/apis/serving\.kserve\.io/v1beta1/namespaces/([^/]+)/inferenceservices(?:/([^/?]+))?")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods\?(.*)$")


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


class StandInKube:
    def __init__(self, ready_after: int | None = 2, not_ready_message: str = "Predictor pods not ready"):
        self.objects: dict[tuple[str, str], dict] = {}
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, body)
        self.fail: dict[tuple[str, int], int] = {}
        self.ports: dict[str, int] = {}
        self.ready_after, self.not_ready_message = ready_after, not_ready_message
        self._gets: dict[tuple[str, str], int] = {}
        self._version = 100
        self._lock = threading.Lock()
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self) -> Any:
        """The real kubernetes CustomObjectsApi, pointed here."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        return client.CustomObjectsApi(client.ApiClient(config))

    def core(self) -> Any:
        """The real kubernetes CoreV1Api, pointed here (pods only)."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        return client.CoreV1Api(client.ApiClient(config))

    def pods(self, namespace: str, query: str) -> dict:
        import urllib.parse

        selector = urllib.parse.parse_qs(query).get("labelSelector", [""])[0]
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        items = []
        for (ns, name), isvc in sorted(self.objects.items()):
            spec = isvc.get("spec", {})
            predictors = [spec.get("predictor", {}), *[c["predictor"] for c in spec.get("canary", [])]]
            for i, predictor in enumerate(predictors):
                labels = predictor.get("labels") or {}
                if ns != namespace or any(labels.get(k) != v for k, v in wanted.items()):
                    continue
                port = self.ports.get(labels.get("kubealign.io/predictor", ""), 8080)
                items.append(
                    {
                        "metadata": {"name": f"{name}-{i}", "namespace": ns, "labels": labels},
                        "spec": {"containers": [{"name": "kserve-container", "ports": [{"containerPort": port}]}]},
                        "status": {
                            "phase": "Running",
                            "podIP": "127.0.0.1",
                            "conditions": [{"type": "Ready", "status": "True"}],
                        },
                    }
                )
        return {"kind": "PodList", "apiVersion": "v1", "items": items}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def calls(self, method: str) -> list[tuple[str, str, Any]]:
        return [r for r in self.requests if r[0] == method]

    def _answer(self, method: str, path: str, body: Any) -> tuple[int, dict]:
        pods = PODS.match(path)
        if pods and method == "GET":
            with self._lock:
                return 200, self.pods(*pods.groups())
        match = PATH.match(path)
        if not match:
            return 404, _status(404, "NotFound", f"no route {path}")
        namespace, name = match.groups()
        with self._lock:
            self.requests.append((method, path, body))
            injected = self.fail.get((method, len(self.calls(method))))
            if injected:
                reason = {403: "Forbidden", 409: "Conflict"}.get(injected, "Injected")
                return injected, _status(injected, reason, f"injected {injected}")
            key = (namespace, name or (body or {}).get("metadata", {}).get("name", ""))
            current = self.objects.get(key)
            if method == "GET":
                if current is None:
                    return 404, _status(404, "NotFound", f'inferenceservices "{key[1]}" not found')
                self._reconcile(key, current)
                return 200, current
            if method == "POST":
                if current is not None:
                    return 409, _status(409, "AlreadyExists", f'inferenceservices "{key[1]}" already exists')
                return self._store(key, body, generation=1)
            if method == "PATCH":
                if current is None:
                    return 404, _status(404, "NotFound", f'inferenceservices "{key[1]}" not found')
                wanted = (body.get("metadata") or {}).get("resourceVersion")
                if wanted and wanted != current["metadata"]["resourceVersion"]:
                    return 409, _status(409, "Conflict", "the object has been modified")
                merged = merge(current, body)
                changed = merged.get("spec") != current.get("spec")
                generation = current["metadata"]["generation"] + (1 if changed else 0)
                return self._store(key, merged, generation=generation)
        return 405, _status(405, "MethodNotAllowed", method)

    def _store(self, key: tuple[str, str], body: dict, generation: int) -> tuple[int, dict]:
        problems = errors(body)
        if problems:
            return 422, _status(422, "Invalid", "; ".join(problems))
        stored = copy.deepcopy(body)
        self._version += 1
        stored["metadata"].update(resourceVersion=str(self._version), generation=generation)
        stored.setdefault("status", {})
        self.objects[key] = stored
        self._gets[key] = 0
        return 200 if generation > 1 or "status" in body else 201, stored

    def _reconcile(self, key: tuple[str, str], obj: dict) -> None:
        self._gets[key] += 1
        if self.ready_after is None:
            obj["status"] = {"conditions": [{"type": "Ready", "status": "False", "message": self.not_ready_message}]}
        elif self._gets[key] > self.ready_after:
            obj["status"] = {
                "observedGeneration": obj["metadata"]["generation"],
                "conditions": [{"type": "Ready", "status": "True"}],
                "url": f"http://{key[1]}.{key[0]}.svc.cluster.local",
            }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _do(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                if self.command == "PATCH":
                    assert self.headers.get("Content-Type") == "application/merge-patch+json", self.headers
                status, answer = standin._answer(self.command, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _do

        return Handler


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
