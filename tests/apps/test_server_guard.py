"""The server against hostile clients (strata_mlx.apps.server.guard and the body limit): a
foreign Host or Origin is a 403 (DNS rebinding), a body over the limit a 413 (by its
Content-Length or as it streams), a stream cut by shutdown ends with its protocol's error event,
connections past the cap or gone quiet are closed, and a soak: a 50 MiB body, slow clients
trickling bodies and many idle connections while a normal client keeps getting answers within a
second and the server's RSS stays bounded."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
import uvicorn
from conftest import wait_until_serving
from test_server import LONG, NAME, load_tiny, running, tiny  # noqa: F401 (tiny: a fixture)

from strata_mlx.apps.server import create_app

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811 (the fixture imported above)
    model, tok = load_tiny(tiny)
    try:
        yield model, tok
    finally:
        model.expert_cache.close()


@pytest.fixture(scope="module")
def base(model):
    app = create_app(
        *model, NAME, max_tokens_limit=LONG, max_body_bytes=LIMIT, allowed_hosts=["myhost.lan"]
    )
    with running(app) as url:
        yield url


BODY = {"model": NAME, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 1}


def test_a_foreign_host_or_origin_is_refused(base):
    port = base.rsplit(":", 1)[1]
    with httpx.Client(base_url=base, trust_env=False, timeout=30) as http:
        for path in ("/v1/models", "/dashboard", "/dashboard/data", "/v1/stats"):
            r = http.get(path, headers={"Host": "evil.example"})
            assert r.status_code == 403, (path, r.text)
            assert "evil.example" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json=BODY, headers={"Host": f"evil.example:{port}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        for host in ("localhost", f"127.0.0.1:{port}", f"[::1]:{port}", "myhost.lan", "LOCALHOST"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
        # a page elsewhere posting to the local server (its Origin), and one on this machine
        evil = {"Origin": "http://evil.example"}
        assert http.post("/v1/chat/completions", json=BODY, headers=evil).status_code == 403
        assert http.get("/v1/models", headers={"Origin": "null"}).status_code == 403
        local = {"Origin": f"http://localhost:{port}"}
        assert http.post("/v1/chat/completions", json=BODY, headers=local).status_code == 200


def test_a_body_over_the_limit_is_a_413(base):
    with httpx.Client(base_url=base, trust_env=False, timeout=30) as http:
        big = json.dumps({**BODY, "messages": [{"role": "user", "content": "a" * LIMIT}]})
        r = http.post(
            "/v1/chat/completions", content=big, headers={"content-type": "application/json"}
        )
        assert r.status_code == 413, r.text
        assert "--max-body-bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(LIMIT // 1024 + 1):
                yield b"a" * 1024
            yield b'"}'

        r = http.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413, r.text
        for path in ("/v1/messages", "/v1/responses"):
            assert http.post(path, content=big).status_code == 413
        assert http.post("/v1/chat/completions", json=BODY).status_code == 200


@contextlib.contextmanager
def cut_server(app):
    """`app` under uvicorn with a short shutdown grace period; yields (url, server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=0.5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


CUT = [
    ("/v1/chat/completions", BODY, "data: [DONE]"),
    ("/v1/messages", {**BODY, "max_tokens": LONG}, "event: error"),
    ("/v1/responses", {"model": NAME, "input": "the cat"}, "event: response.failed"),
]


@pytest.mark.parametrize("path,body,last", CUT, ids=["openai", "anthropic", "responses"])
def test_a_stream_cut_at_shutdown_ends_with_an_error_event(model, path, body, last):
    endless = copy.copy(model[1])
    endless.eos_token_ids = set()  # the text runs until shutdown cuts it
    app = create_app(model[0], endless, NAME, max_tokens_limit=LONG, default_max_tokens=LONG)
    body = {**body, "stream": True}
    if path != "/v1/messages":
        body["max_tokens" if path == "/v1/chat/completions" else "max_output_tokens"] = LONG
    with cut_server(app) as (url, server):
        with httpx.Client(trust_env=False, timeout=60) as http:
            with http.stream("POST", url + path, json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                seen = [next(lines) for _ in range(3)]  # generation is under way
                server.should_exit = True  # SIGTERM; the stream runs past the grace period
                seen += list(lines)
    events = [line for line in seen if line]
    assert any(e.startswith(last) for e in events[-2:]), events[-3:]
    assert "shut down" in "".join(events[-3:])


def _closed(s: socket.socket, within: float) -> bool:
    """Whether the server closes `s` (after any answer it sends) within `within` seconds."""
    s.settimeout(within)
    try:
        while data := s.recv(4096):
            del data
    except TimeoutError:
        return False
    except OSError:  # reset
        pass
    return True


def test_connections_past_the_cap_or_gone_quiet_are_closed(model):
    """A client that opens connections and sends nothing, or half a head, held each one for
    good, and enough of them took every file descriptor: past the cap a new connection closes
    the oldest one waiting on its client; one quiet for the stall time is closed; a client that
    keeps sending, and a request in the app's hands, are never cut."""
    from strata_mlx.apps.server.guard import guarded_http

    app = create_app(*model, NAME, max_tokens_limit=LONG)
    with running(app, http=guarded_http(limit=16, stall_s=60.0)) as base:
        port = int(base.rsplit(":", 1)[1])
        quiet = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
        # past the cap each new one closed the quietest: the first 34 are gone at once
        assert [_closed(s, 5.0) for s in quiet[:34]] == [True] * 34
        assert [_closed(s, 0.2) for s in quiet[34:]] == [False] * 16
        with httpx.Client(base_url=base, trust_env=False, timeout=5) as http:
            t = time.monotonic()
            assert http.get("/v1/models").status_code == 200
            assert time.monotonic() - t < 2.0
        for s in quiet:
            s.close()
        # the quietest goes, not the oldest: the oldest of 16 has just sent half a head
        time.sleep(0.5)  # (the closes above land)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        time.sleep(0.2)
        held[0].sendall(b"GET /v1/models HTTP/1.1\r\n")
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)):
            assert _closed(held[1], 5.0) and not _closed(held[0], 0.2)
        for s in held:
            s.close()
    app = create_app(*model, NAME, max_tokens_limit=LONG)
    with running(app, http=guarded_http(limit=16, stall_s=2.0)) as base:
        port = int(base.rsplit(":", 1)[1])
        quiet = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        half = []
        for _ in range(5):
            half.append(socket.create_connection(("127.0.0.1", port)))
            half[-1].sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
        # under the cap: closed once quiet for 2 s
        assert all(_closed(s, 10.0) for s in quiet + half)
        # a body a byte each 0.3 s, 3 s in all: never quiet for 2 s, answered
        body = json.dumps({"model": NAME, "prompt": "the cat", "max_tokens": 1}).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
            for i in range(10):
                time.sleep(0.3)
                s.sendall(body[i : i + 1])
            s.sendall(body[10:])
            s.settimeout(30)
            assert s.recv(100).startswith(b"HTTP/1.1 200")
    # with every connection's request in the app's hands (two streams left unread), a new one
    # is answered 503 at once
    with running(app_for_cap(model), http=guarded_http(limit=2, stall_s=1.0)) as base:
        port = int(base.rsplit(":", 1)[1])
        never = {str(i): -100 for i in model[1].eos_token_ids}  # streams that run on
        long = json.dumps({"model": NAME, "prompt": "the cat", "max_tokens": LONG,
                           "stream": True, "logit_bias": never}).encode()  # fmt: skip
        streams = []
        for _ in range(2):
            streams.append(socket.create_connection(("127.0.0.1", port)))
            streams[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                % len(long) + long)  # fmt: skip
        time.sleep(1.5)  # past the stall time: neither is cut
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(5)
            answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        for s in streams:
            s.settimeout(5)
            assert s.recv(12).startswith(b"HTTP/1.1 200")
            s.close()


def app_for_cap(model):
    return create_app(*model, NAME, max_tokens_limit=LONG, max_queue=4)


def rss_mb(pid: int) -> float:
    return int(subprocess.check_output(["ps", "-o", "rss=", "-p", str(pid)])) / 1024


def hostile_clients(port: int, slow: int, conns: int, huge_mb: int, stop: threading.Event):
    """Start the attackers on threads: one body of `huge_mb` MiB, `slow` clients trickling a
    body a byte at a time, `conns` idle connections."""

    def huge():  # a valid request: a prompt of huge_mb MiB of words
        body = b'{"prompt": "' + b"the cat " * (huge_mb << 17) + b'"}'
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            s.settimeout(0.5)
            with contextlib.suppress(TimeoutError):  # refused at once by its length
                answers.append(s.recv(100).split(b" ")[1])
            s.settimeout(120)
            s.sendall(body)  # or sent, as a server without a limit reads it
            answers.append(s.recv(100).split(b" ")[1])

    def trickle():
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                b"application/json\r\nContent-Length: 100000\r\n\r\n"
            )
            while not stop.wait(0.05):
                s.sendall(b"a")

    idle, answers = [], []
    for _ in range(conns):
        with contextlib.suppress(OSError):
            idle.append(socket.create_connection(("127.0.0.1", port)))
    threads = [threading.Thread(target=huge, daemon=True)]
    threads += [threading.Thread(target=trickle, daemon=True) for _ in range(slow)]
    for t in threads:
        t.start()
    return answers, idle


def soak(tiny, seconds: float, huge_mb: int, slow: int, conns: int):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", str(tiny), "--port", str(port)]
    cmd += ["--model-name", NAME, "--log-level", "critical", "--arena-gb", "0.001"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stop = threading.Event()
    url = f"http://127.0.0.1:{port}/v1/completions"
    probe = {"model": NAME, "prompt": "the cat", "max_tokens": 1}
    try:
        wait_until_serving(
            [proc],
            lambda: httpx.post(url, json=probe, trust_env=False),
            ready=lambda r: r.status_code == 200,
        )
        idle = rss_mb(proc.pid)
        huge, sockets = hostile_clients(port, slow, conns, huge_mb, stop)
        worst, peak, answers = 0.0, idle, 0
        end = time.monotonic() + seconds
        with httpx.Client(trust_env=False, timeout=10) as http:
            while time.monotonic() < end:
                t = time.monotonic()
                r = http.post(url, json=probe)
                worst = max(worst, time.monotonic() - t)
                assert r.status_code == 200, r.text
                answers += 1
                peak = max(peak, rss_mb(proc.pid))
                time.sleep(0.1)
        stop.set()
        for s in sockets:
            s.close()
        assert answers >= seconds, answers
        assert huge[:1] == [b"413"], huge
        assert worst < 1.0, worst
        assert peak - idle < 1024, (idle, peak)
        return worst, idle, peak
    finally:
        stop.set()
        proc.kill()
        proc.wait()


def test_the_server_answers_while_hostile_clients_hit_it(tiny):  # noqa: F811
    soak(tiny, seconds=4, huge_mb=50, slow=20, conns=50)


@pytest.mark.slow
def test_the_server_answers_through_a_long_soak(tiny):  # noqa: F811
    worst, idle, peak = soak(tiny, seconds=60, huge_mb=50, slow=20, conns=500)
    print(f"soak: slowest answer {worst:.3f} s, RSS {idle:.0f} MB idle, {peak:.0f} MB peak")


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(model, tmp_path):
    """A byte-level BPE token stands for at most its longest vocabulary entry's characters:
    text past max_prompt_tokens times that is refused without tokenizing it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from strata_mlx.generation.tokenizer import Tokenizer as StrataTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["the cat sat on the mat"] * 10, trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    longest = max(len(t) for t in bpe.get_vocab())
    tok = StrataTokenizer(tmp_path)
    app = create_app(model[0], tok, NAME, max_prompt_tokens=100)
    with running(app) as url, httpx.Client(base_url=url, trust_env=False, timeout=30) as http:
        text = "the cat " * (100 * longest // 8 + 1)
        r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        r = http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 1})
        assert "characters" not in r.text


def test_a_server_uvicorn_fails_to_start_exits(tiny):  # noqa: F811
    """uvicorn failing before its lifespan (here a log level it does not know) left the
    server's worker thread running: the process printed the error and never exited."""
    code = (
        "import sys; from strata_mlx.apps.server import serve\n"
        f"try: serve({str(tiny)!r}, port=0, log_level='bogus')\n"
        "except Exception as e: print(repr(e)); sys.exit(7)\n"  # (uvicorn's error: KeyError)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 7, r.stderr[-2000:]
    assert "bogus" in r.stdout  # (uvicorn's own error, after the model and its worker are up)
    assert "OpenAI-compatible API at" in r.stdout


@pytest.mark.parametrize("key", [None, "k"])
def test_serving_beyond_loopback_without_a_key_is_warned_of(tiny, key):  # noqa: F811
    import os
    import signal

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "strata_mlx", "serve", "--model", str(tiny), "--port", str(port)]
    cmd += ["--model-name", NAME, "--log-level", "critical", "--host", "0.0.0.0"]
    env = {k: v for k, v in os.environ.items() if k != "STRATA_MLX_API_KEY"}
    if key is not None:
        env["STRATA_MLX_API_KEY"] = key
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_serving(
            [proc], lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False)
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    warned = "warning: --host 0.0.0.0 without --api-key: anyone who reaches this address"
    assert (warned in err) == (key is None), err
