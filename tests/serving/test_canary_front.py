"""The local canary (issue 39): the traffic split of `kubealign serve --canary` (kubealign.serving.split)
before two completions servers on 127.0.0.1, and `kubealign judge --front --act` carrying its verdict out in
a registry (sqlite) and in that front. The servers are tests/test_judge's stand-ins of vLLM's completions
route; `kubealign serve` with vLLM's real servers behind the front: tests/serving/test_serve_vllm.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kubealign.errors import UserError
from kubealign.serving import split
from tests.stages.test_judge import Completions, judge_config, listing
from tests.stages.test_judge import split as split_dir  # noqa: F401 (the data-split fixture)
from tests.support.faults import free_port

pytestmark = pytest.mark.faults


def test_the_canary_gets_exactly_its_share_evenly_spread() -> None:
    # p of every 100: request k is the canary's when floor((k+1)p/100) > floor(kp/100)
    assert [k for k in range(100) if split.to_canary(k, 10)] == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]
    assert [k for k in range(8) if split.to_canary(k, 50)] == [1, 3, 5, 7]
    assert [k for k in range(200) if split.to_canary(k, 1)] == [99, 199]
    assert [k for k in range(100) if not split.to_canary(k, 99)] == [0]
    assert sum(split.to_canary(k, 33) for k in range(300)) == 99
    assert [k for k in range(10) if split.to_canary(k, 25)] == [3, 7]


def completion(url: str, prompt: str = "abc") -> tuple[int, str, str]:
    """(status, the answering model's label, the answer's text or the error) of one request to url."""
    body = json.dumps({"model": "actor", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            payload = json.loads(reply.read())
            return reply.status, reply.headers[split.SERVED_HEADER], payload["choices"][0]["text"]
    except urllib.error.HTTPError as exc:
        return exc.code, "", json.loads(exc.read())["error"]


def test_the_front_splits_the_traffic_and_serves_one_version_when_told() -> None:
    """20 requests at 10 %: the 10th and the 20th are the canary's, each answer says who gave it. The route
    names both servers; one version made the whole service: every request its, the other's server is free."""
    stable, canary = Completions(lambda p: " stable"), Completions(lambda p: " canary")
    route = split.Route(split.Backend("champion", "1", stable.url), split.Backend("challenger", "2", canary.url), 10)
    port = free_port()
    front, url = split.start(port, route), f"http://127.0.0.1:{port}"
    try:
        got = [completion(url) for _ in range(20)]
        assert [k for k, (_, who, _) in enumerate(got) if who == "challenger@2"] == [9, 19]
        assert {(status, who, text) for status, who, text in got} == {
            (200, "champion@1", " stable"),
            (200, "challenger@2", " canary"),
        }
        assert split.read_route(url) == {
            "stable": {"alias": "champion", "version": "1", "url": stable.url},
            "canary": {"alias": "challenger", "version": "2", "url": canary.url},
            "percent": 10,
        }
        with pytest.raises(UserError, match="HTTP 409: version 7 is not served here .served: champion@1, challenger@2"):
            split.serve_only(url, "7")
        assert not route.changed.is_set() and route.canary is not None
        assert split.serve_only(url, "2") == "updated" and route.changed.is_set()
        assert split.serve_only(url, "2") == "unchanged"
        with pytest.raises(UserError, match=r"HTTP 409: version 1 is not served here \(served: challenger@2\)"):
            split.serve_only(url, "1")  # its server is gone: it cannot be made the service again
        assert {completion(url)[1] for _ in range(12)} == {"challenger@2"}
        assert split.read_route(url)["canary"] is None and route.served() == [route.stable]
        canary.stop()  # its server gone: the front answers 502 naming it
        status, _, error = completion(url)
        assert status == 502 and error.startswith(f"challenger@2 at {canary.url}: ")
    finally:
        front.stop()
        stable.stop()
    assert not split.token_file(port).exists()  # the stopped front's token is gone with it
    with pytest.raises(UserError, match=f"--front {url}: cannot read its token .*127.0.0.1-{port}.token"):
        split.read_route(url)
    split.new_token(port)  # a token left, nothing listening: not a front
    with pytest.raises(UserError, match=f"--front {url}: not a kubealign serve --canary front"):
        split.read_route(url)


def registry_with(uri: str, name: str, versions: int, source: Path, **aliases: str) -> None:
    """A registered model with `versions` versions and these aliases (sqlite: no server needed)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.create_registered_model(name)
    for _ in range(versions):
        client.create_model_version(name, source=str(source))
    for alias, version in aliases.items():
        client.set_registered_model_alias(name, alias, version)


def test_judge_front_act_rolls_back_a_worse_canary_and_a_rerun_finishes_a_promotion(
    split_dir: Path,  # noqa: F811
    tmp_path: Path,
    cli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 2 answers curtly (the reward function gives it 0, the champion 1): `judge --front --act` rolls
    it back: challenger cleared and tagged, the front serves version 1 alone. Version 3, courteous against a
    curt champion, holds: champion moves to it, and the front's update fails once (the crash between the
    registry and the served model); the rerun moves no alias and makes version 3 the whole service."""
    from mlflow.tracking import MlflowClient

    from kubealign.models import loading
    from kubealign.serving import carry_out
    from tests.faults.test_faults_registry import aliases

    uri, name = f"sqlite:///{tmp_path / 'registry.db'}", "front-actor"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    registry_with(uri, name, 2, tmp_path, champion="1", challenger="2")
    # curt but not degenerate: the promotion guards bound the length ratio (issue 53)
    courteous, curt = Completions(lambda p: " Certainly! Here it is."), Completions(lambda p: " No, I cannot help.")
    courteous.models, curt.models = listing(name, "1"), listing(name, "2")  # as kubealign serve names them
    sets = ["--set", f"promote.registered_model={name}", "--set", "canary.min_answers=3"]
    base = [
        "judge",
        "--config",
        judge_config(tmp_path),
        *sets,
        "--prompts",
        split_dir,
        "--tokenizer",
        loading.resolve("tiny-opt"),
        "--act",
    ]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    route = split.Route(split.Backend("champion", "1", courteous.url), split.Backend("challenger", "2", curt.url), 50)
    front = split.start(port, route)
    try:
        done = cli(*base, "--front", url, "--output", tmp_path / "worse")
        assert done.code == 0, done.err
        assert "judge: challenger (version 2) rolled back: win_rate: needs >= 0.5, got 0.000" in done.out
        assert f"serving: {url} updated: version 1 alone" in done.out
        assert aliases(uri, name) == {"champion": "1"}
        assert MlflowClient(uri).get_model_version(name, "2").tags[carry_out.REJECTED_TAG] == "rejected"
        assert route.describe()["canary"] is None and route.stable.version == "1"
        assert {completion(url)[1] for _ in range(4)} == {"champion@1"}
        # judged again: nothing left to judge at that front
        done = cli(*base, "--front", url, "--output", tmp_path / "again")
        assert done.code == 2 and f"--front {url}: serves version 1 alone: no canary to judge" in done.err
    finally:
        front.stop()

    # version 3 is the challenger now; its front splits 50/50 with the curt champion version 1
    MlflowClient(uri).create_model_version(name, source=str(tmp_path))
    MlflowClient(uri).set_registered_model_alias(name, "challenger", "3")
    MlflowClient(uri).set_registered_model_alias(name, "champion", "1")
    route = split.Route(split.Backend("champion", "1", curt.url), split.Backend("challenger", "3", courteous.url), 50)
    curt.models, courteous.models = listing(name, "1"), listing(name, "3")
    front = split.start(port, route)
    real = carry_out.in_local
    calls = []

    def crash_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise UserError("the front went away")
        return real(*args)

    monkeypatch.setattr(carry_out, "in_local", crash_once)
    try:
        done = cli(*base, "--front", url, "--output", tmp_path / "better")
        assert done.code == 2 and "the front went away" in done.err
        assert aliases(uri, name) == {"champion": "3", "previous-champion": "1"}  # decided in the registry
        assert route.canary is not None  # still split
        done = cli(*base, "--front", url, "--output", tmp_path / "rerun")
        assert done.code == 0, done.err
        assert "holds online: promoted to champion" in done.out and "updated: version 3 alone" in done.out
        assert aliases(uri, name) == {"champion": "3", "previous-champion": "1"}  # the rerun moved nothing
        assert route.canary is None and route.stable.version == "3"
        assert {completion(url)[1] for _ in range(4)} == {"challenger@3"}
        # a front whose canary is not the registry's challenger is refused before any request
        MlflowClient(uri).set_registered_model_alias(name, "challenger", "2")
        route.canary, route.percent = split.Backend("challenger", "1", curt.url), 50
        done = cli(*base, "--front", url, "--output", tmp_path / "stale")
        assert done.code == 2 and f"--front {url}: its canary is version 1, challenger is 2" in done.err
        assert not (tmp_path / "stale").exists()
    finally:
        front.stop()
        courteous.stop()
        curt.stop()


def test_the_judge_refuses_to_act_when_the_canary_url_serves_the_champions_version(
    split_dir: Path,  # noqa: F811
    tmp_path: Path,
    cli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--canary names a server of version 1, the champion (a swapped or mistyped URL, or a backend replaced):
    refused in one line before any prompt is asked; no alias moves, no output. Both right: judged and acted."""
    from kubealign.models import loading
    from tests.faults.test_faults_registry import aliases

    uri, name = f"sqlite:///{tmp_path / 'registry.db'}", "checked-actor"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    registry_with(uri, name, 2, tmp_path, champion="1", challenger="2")
    asked: list[str] = []
    champion = Completions(lambda p: " No, I cannot help.", listing(name, "1"))
    wrong = Completions(lambda p: asked.append(p) or " Certainly! Here it is.", listing(name, "1"))
    canary = Completions(lambda p: " Certainly! Here it is.", listing(name, "2"))
    base = [
        "judge",
        "--config",
        judge_config(tmp_path),
        "--set",
        f"promote.registered_model={name}",
        "--set",
        "canary.min_answers=3",
        "--prompts",
        split_dir,
        "--tokenizer",
        loading.resolve("tiny-opt"),
        "--act",
    ]
    try:
        done = cli(*base, "--champion", champion.url, "--canary", wrong.url, "--output", tmp_path / "wrong")
        assert done.code == 2 and done.err.count("\n") == 1, done.err
        assert (
            f"judge: {wrong.url} serves 'models:/{name}/1' but the judged canary is version 2 (models:/{name}/2); "
            "nothing was judged or changed"
        ) in done.err
        assert aliases(uri, name) == {"champion": "1", "challenger": "2"} and not (tmp_path / "wrong").exists()
        assert asked == []  # refused before any prompt
        # the champion's URL given for the canary's: refused the same way, on the champion's side too
        done = cli(*base, "--champion", canary.url, "--canary", champion.url, "--output", tmp_path / "swapped")
        assert (
            done.code == 2 and f"judge: {canary.url} serves 'models:/{name}/2' but the registry's champion" in done.err
        )
        assert aliases(uri, name) == {"champion": "1", "challenger": "2"}
        done = cli(*base, "--champion", champion.url, "--canary", canary.url, "--output", tmp_path / "right")
        assert done.code == 0, done.err
        assert aliases(uri, name) == {"champion": "2", "previous-champion": "1"}
        checks = json.loads((tmp_path / "right" / "result.json").read_text())["checks"]
        assert checks[:2] == [
            f"pass: champion {champion.url} serves models:/{name}/1 (the registry's champion)",
            f"pass: canary {canary.url} serves models:/{name}/2 (the judged canary)",
        ]
    finally:
        for server in (champion, wrong, canary):
            server.stop()


def test_judge_urls_are_given_one_way(cli, tmp_path: Path) -> None:
    both = ["--champion", "http://127.0.0.1:1", "--canary", "http://127.0.0.1:2"]
    base = ["judge", "--prompts", tmp_path, "--tokenizer", tmp_path, "--output", tmp_path / "o"]
    done = cli(*base, *both, "--front", "http://127.0.0.1:3")
    assert done.code == 2 and "--front: the local split names both servers" in done.err
    done = cli(*base, "--champion", "http://127.0.0.1:1")
    assert done.code == 2 and "give --front URL (kubealign serve --canary) or both --champion" in done.err
    done = cli(*base, "--front", "http://127.0.0.1:3", "--act", "--namespace", "team-a")
    assert done.code == 2 and "--namespace: the cluster's service, --front: the local one; give one" in done.err


def pod(name: str, version: str, ready: bool = True, ip: str | None = "10.0.0.1", port: int | None = 9000) -> dict:
    ports = [{"containerPort": port}] if port else []
    return {
        "metadata": {"name": name, "labels": {"kubealign.io/model-version": version}},
        "spec": {
            "containers": [
                {"name": "queue-proxy", "ports": [{"containerPort": 1}]},
                {"name": "kserve-container", "ports": ports},
            ]
        },
        "status": {
            "phase": "Running",
            **({"podIP": ip} if ip else {}),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_a_predictor_is_a_ready_pod_of_its_version_at_its_model_containers_port() -> None:
    from kubealign.serving.endpoints import pick

    old = pod("a-old", "1", ip="10.0.0.9")  # during a rollout the old version's pods still run
    assert pick([old, pod("b", "2", ready=False), pod("c", "2", ip=None)], "2") is None
    assert pick([old, pod("z", "2", ip="10.0.0.3"), pod("d", "2", ip="10.0.0.2")], "2") == "http://10.0.0.2:9000"
    assert pick([old, pod("d", "2", port=None)], "2") == "http://10.0.0.1:8080"  # the runtimes' port
    pending = pod("e", "2")
    pending["status"]["phase"] = "Pending"
    assert pick([pending], "2") is None and pick([old], "1") == "http://10.0.0.9:9000"


def test_no_ready_pod_of_a_predictor_is_one_line() -> None:
    from kubealign.serving.endpoints import predictor_url
    from tests.support.kube_standin import StandInKube

    kube = StandInKube()
    try:
        with pytest.raises(
            UserError, match="^judge: no Ready pod of team-a/actor's canary predictor serves version 3$"
        ):
            predictor_url(kube.core(), "team-a", "actor", "canary", "3")
    finally:
        kube.stop()


# --- the front against an adversary (issue 54): a web page in a local browser, a greedy client, a backend ----


class Echo:
    """A backend that answers every request with what it got (method, path, headers, body) and tries to
    pass its own headers on: a forged answer label, and a header it names in Connection:."""

    def __init__(self, name: str) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from threading import Thread

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                headers = {k.lower(): v for k, v in self.headers.items()}
                got = {"backend": name, "path": self.path, "headers": headers, "body": self.rfile.read(size).decode()}
                body = json.dumps(got).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header(split.SERVED_HEADER, "champion@999")
                self.send_header("Connection", "close, x-backend-secret")
                self.send_header("X-Backend-Secret", "s3cret")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def echo_front():
    """A front at 50 % before two echo backends, with small limits a test can reach."""
    stable, canary = Echo("stable"), Echo("canary")
    route = split.Route(split.Backend("champion", "1", stable.url), split.Backend("challenger", "2", canary.url), 50)
    port = free_port()
    front = split.start(port, route, limits=split.Limits(max_body_bytes=1000, idle_timeout_s=1.0, max_connections=3))
    yield port, route
    front.stop()
    stable.stop()
    canary.stop()


def raw(port: int, request: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as written on a fresh connection; (status, headers, body) of the answer, 0 when the
    front closed the connection without one."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    if not data:
        return 0, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers.setdefault(key.strip().lower(), value.strip())
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return f"POST {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_a_web_page_cannot_change_the_route(echo_front) -> None:
    """What any page open in a local browser can send (a simple cross-origin POST) moves nothing; nor does a
    '//' path, a wrong token, a foreign Host or a non-JSON body with the token. The judge's own request does."""
    port, route = echo_front
    token = split.token_file(port).read_text()
    only = json.dumps({"only": "2"}).encode()
    page = ("Host: evil.example", "Origin: http://evil.example", "Content-Type: text/plain")
    assert raw(port, post(split.ROUTE_PATH, only, *page))[0] == 403
    assert raw(port, post(split.ROUTE_PATH, only, f"Host: 127.0.0.1:{port}", "Content-Type: text/plain"))[0] == 401
    assert raw(port, post("//kubealign/route", only, f"Host: 127.0.0.1:{port}"))[0] == 400
    wrong = (f"Host: 127.0.0.1:{port}", "Content-Type: application/json", "Authorization: Bearer " + "x" * 43)
    assert raw(port, post(split.ROUTE_PATH, only, *wrong))[0] == 401
    text = (f"Host: 127.0.0.1:{port}", f"Authorization: Bearer {token}", "Content-Type: text/plain")
    status, _, body = raw(port, post(split.ROUTE_PATH, only, *text))
    assert status == 415 and b"Content-Type: application/json" in body
    assert route.canary is not None and route.stable.version == "1" and not route.changed.is_set()
    assert split.serve_only(f"http://127.0.0.1:{port}", "2") == "updated" and route.stable.version == "2"
    assert oct(split.token_file(port).stat().st_mode & 0o777) == "0o600"


def test_bodies_lengths_and_paths_are_bounded_and_one_line(echo_front) -> None:
    port, _ = echo_front
    status, _, body = raw(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
    assert status == 413 and json.loads(body) == {"error": "the body is 5000 bytes, over the front's 1000"}
    for length in (b"abc", b"-1", b"99999999999999999999999"):
        status, _, body = raw(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: " + length + b"\r\n\r\n")
        assert status in (400, 413) and "\n" not in json.loads(body)["error"]
    assert raw(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n")[0] == 400
    status, _, body = raw(port, b"GET http://evil.example/v1/models HTTP/1.1\r\n\r\n")
    assert status == 400 and "must start with one '/'" in json.loads(body)["error"]
    chunked = b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"x" * 1024
    assert raw(port, chunked + b"\r\n0\r\n\r\n")[0] == 413


def test_chunked_bodies_reach_the_backend_whole(echo_front) -> None:
    port, _ = echo_front
    head = b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
    chunks = b'5\r\n{"a":\r\n3;ext=1\r\n 12\r\n1\r\n}\r\n0\r\nX-Trailer: t\r\n\r\n'  # a chunk extension, a trailer
    request = head + chunks
    status, _, body = raw(port, request)
    got = json.loads(body)
    assert status == 200 and got["body"] == '{"a": 12}' and got["headers"]["content-length"] == "9"
    assert "transfer-encoding" not in got["headers"]


def test_a_backend_cannot_label_its_answer_or_pass_connection_headers(echo_front) -> None:
    """The answer label is the front's alone; a header the backend names in Connection: stops at the front, and
    so does one the client names."""
    port, _ = echo_front
    request = post("/v1/completions", b"{}", "Connection: close, x-client-secret", "X-Client-Secret: c")
    status, headers, body = raw(port, request)
    assert status == 200 and headers[split.SERVED_HEADER] == "champion@1"
    assert "x-backend-secret" not in headers
    assert "x-client-secret" not in json.loads(body)["headers"]


def test_only_api_requests_take_canary_slots(echo_front) -> None:
    """At 50 % the canary answers API requests 1, 3, 5 ... whatever health probes come between them."""
    port, _ = echo_front
    backends = []
    probe = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    for _ in range(6):
        assert raw(port, probe)[1][split.SERVED_HEADER] == "champion@1"
        backends.append(raw(port, post("/v1/completions", b"{}"))[1][split.SERVED_HEADER])
    assert backends == ["champion@1", "challenger@2"] * 3


def test_idle_clients_are_dropped_and_connections_bounded(echo_front) -> None:
    """A client that sends nothing is dropped after the idle timeout (1 s here); while 3 idle clients hold
    the front's 3 places, a fourth request gets a 503 at once, and an answer again once they are dropped."""
    import socket
    import time

    port, _ = echo_front
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        time.sleep(0.2)
        status, _, body = raw(port, post("/v1/completions", b"{}"), timeout=5)
        assert status == 503 and "serves 3 requests at once" in json.loads(body)["error"]
        started = time.monotonic()
        assert [sock.recv(1) for sock in idle] == [b""] * 3  # closed by the front
        assert time.monotonic() - started < 5
    finally:
        for sock in idle:
            sock.close()
    assert raw(port, post("/v1/completions", b"{}"))[0] == 200
