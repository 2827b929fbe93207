"""`mg-serve`: the OpenAI API over one engine, checked with the real `openai` client on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
import torch
from click.testing import CliRunner

# The serving stack comes with the test extras (CI installs them); a GPU host running only the CUDA tests
# may lack it, and then skips this module.
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_dflash_seq_artifact):
    import uvicorn

    from mg.runtime.artifact import load_artifact
    from mg.runtime.config import RunConfig
    from mg.runtime.engine import Engine
    from mg.runtime.http_server import EngineWorker, Metrics, ServerState, create_app
    from mg.runtime.tokenizer import TextCodec

    art = load_artifact(tiny_dflash_seq_artifact)
    engine = Engine(art, RunConfig())
    metrics = Metrics()
    worker = EngineWorker(engine, metrics)
    worker.start()
    state = ServerState(worker=worker, codec=TextCodec(art.tokenizer_path, art.manifest.model.bos_id),
                        model=art.manifest.model.name, capacity=art.manifest.kv.capacity,
                        check=engine.scheduler.check, max_queue=4, n_slots=engine.cache.n_slots, api_key=None,
                        metrics=metrics, chat_template=TEMPLATE)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                        lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(10)
    worker.stop()
    worker.join(10)


def _http(base, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    """One plain HTTP exchange -> (status, JSON body)."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = body if isinstance(body, (str, type(None))) else json.dumps(body)
    conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, {"text": raw.decode()}


class _Stream:
    """A streaming completion read line by line; closing it drops the connection (a client going away)."""

    def __init__(self, base, body):
        u = urlparse(base)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        self.conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                          headers={"content-type": "application/json"})
        self.response = self.conn.getresponse()

    def first_data(self) -> str:
        while True:
            line = self.response.readline().decode()
            if line.startswith("data:"):
                return line

    def close(self):
        if self.conn.sock is not None:
            self.conn.sock.close()
        self.conn.close()


def _client(base, key="none"):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def _mg_run_text(artifact, prompt: str, n: int) -> str:
    from mg.runtime.cli import main

    out = CliRunner().invoke(main, [str(artifact), "--prompt", prompt, "--max-new-tokens", str(n)]).output
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))["text"]


def _wait_idle(state, seconds=5.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if state.worker.in_flight == 0 and not state.worker.engine.scheduler.running:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("prompt", ["def add(a, b):", "import os\n"])
def test_greedy_completion_equals_mg_run_streamed_or_not(server, tiny_dflash_seq_artifact, prompt):
    base, _ = server
    want = _mg_run_text(tiny_dflash_seq_artifact, prompt, 12)
    client = _client(base)
    whole = client.completions.create(model="preset-tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.object == "text_completion"
    chunks = list(client.completions.create(model="preset-tiny", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) >= 2


def test_chat_streamed_and_not(server):
    base, _ = server
    client = _client(base)
    messages = [{"role": "user", "content": "write a loop"}]
    whole = client.chat.completions.create(model="preset-tiny", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="preset-tiny", messages=messages, max_tokens=6,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_chat_without_a_template_is_a_clear_400(server):
    base, state = server
    state.chat_template = None
    try:
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            _client(base).chat.completions.create(model="preset-tiny", messages=[{"role": "user", "content": "x"}])
    finally:
        state.chat_template = TEMPLATE


def test_stop_string_ends_the_text_before_it_and_frees_the_slot(server):
    base, state = server
    client = _client(base)
    full = client.completions.create(model="preset-tiny", prompt="def main():", max_tokens=16, temperature=0).choices[0].text
    printable = [i for i in range(2, len(full) - 2) if full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i]
    assert printable, full
    stop = full[printable[0]:printable[0] + 2]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model="preset-tiny", prompt="def main():", max_tokens=16, temperature=0, stop=[stop],
                                                    stream=True))
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(model="preset-tiny", prompt="def main():", max_tokens=16, temperature=0,
                                               stop=stop).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert text == full[:printable[0]] and reason == "stop"
    assert _wait_idle(state)


def test_a_client_that_disconnects_frees_its_slot_and_the_next_request_is_served(server):
    base, state = server
    stream = _Stream(base, {"prompt": "x", "max_tokens": 80, "temperature": 0})
    assert stream.first_data()
    assert state.worker.engine.scheduler.running  # generating now
    stream.close()
    assert _wait_idle(state), "the disconnected request still holds its slot"
    cache = state.worker.engine.cache
    assert all(n == 0 for n in cache.metrics().lengths)
    assert _client(base).completions.create(model="preset-tiny", prompt="x", max_tokens=3, temperature=0).choices[0].text is not None


def test_a_full_server_answers_429_at_once(server):
    base, state = server
    state.max_queue = 0
    streams = []
    try:
        for _ in range(state.n_slots):  # greedy: no stream ends early on a sampled EOS, freeing its slot
            streams.append(_Stream(base, {"prompt": "x", "max_tokens": 80, "temperature": 0}))
            streams[-1].first_data()
        assert len(state.worker.engine.scheduler.running) == state.n_slots
        t0 = time.perf_counter()
        status, body = _http(base, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and time.perf_counter() - t0 < 2
        assert body["error"]["code"] == "queue_full"
    finally:
        for stream in streams:
            stream.close()
        state.max_queue = 4
    assert _wait_idle(state)


def test_api_key_is_required_when_set(server):
    base, state = server
    state.api_key = "sesame"
    try:
        with pytest.raises(openai.AuthenticationError):
            _client(base).completions.create(model="preset-tiny", prompt="x", max_tokens=2)
        assert _client(base, "sesame").completions.create(model="preset-tiny", prompt="x", max_tokens=2).choices
        assert _http(base, "GET", "/health")[0] == 200  # health stays open
    finally:
        state.api_key = None


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x" * 300, "max_tokens": 10}, "prompt"),
])
def test_bad_requests_get_400_with_the_openai_error_shape(server, body, param):
    base, _ = server
    status, answer = _http(base, "POST", "/v1/completions", body)
    err = answer["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"]
    if param == "prompt" and isinstance(body, dict) and len(body.get("prompt", "")) == 300:
        assert "301" in err["message"] or "310" in err["message"]  # names prompt + max_tokens and the capacity
        assert "96" in err["message"]


def test_models_health_and_metrics(server):
    base, _ = server
    assert _http(base, "GET", "/health") == (200, {"status": "ok"})
    assert [m.id for m in _client(base).models.list().data] == ["preset-tiny"]
    text = _http(base, "GET", "/metrics")[1]["text"]
    for name in ("mg_requests_total", "mg_prompt_tokens_total", "mg_generation_tokens_total", "mg_queue_depth",
                 "mg_running_sequences", "mg_step_seconds_bucket", "mg_time_to_first_token_seconds_bucket",
                 "mg_dflash_acceptance_length_bucket"):
        assert name in text, name


def _serve_process(artifact, *flags) -> tuple[subprocess.Popen, int]:
    """`mg-serve ARTIFACT` in a child process on a free port, once /health answers."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mg.runtime.serve_cli", str(artifact), "--port", str(port),
                             *flags], stderr=subprocess.PIPE, text=True, env={**os.environ})
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        try:
            if _http(f"http://127.0.0.1:{port}", "GET", "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    return proc, port


@pytest.mark.slow
def test_sigterm_stops_the_server_with_exit_code_0(tiny_seq_artifact):
    proc, _ = _serve_process(tiny_seq_artifact)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        said = proc.stderr.read()
        assert "mg-serve: stopped" in said
        cores = torch.get_num_threads()  # torch's default here: the server keeps one core for the HTTP side
        assert f"cpu, {max(1, cores - 1)} threads) on http://127.0.0.1:" in said, said
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_busy_port_is_refused_in_one_line(tiny_seq_artifact):
    from mg.runtime.serve_cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(main, [str(tiny_seq_artifact), "--port", str(port)])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output


@pytest.mark.slow
def test_sigterm_cuts_a_running_stream_with_a_final_chunk_and_exits_0(tmp_path_factory):
    from mg.export.cli import main as export_main

    art = tmp_path_factory.mktemp("long") / "art"  # a long context: generation outlasts the grace period
    result = CliRunner().invoke(export_main, ["--preset", "tiny", "--max-context", "2048", "--max-kv-seqs", "2",
                                              "-o", str(art)])
    assert result.exit_code == 0, result.output
    proc, port = _serve_process(art, "--shutdown-timeout", "2")
    try:
        stream = _Stream(f"http://127.0.0.1:{port}", {"prompt": "x", "max_tokens": 2000, "temperature": 0,
                                                      "stream_options": {"include_usage": True}})
        assert stream.first_data()
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        lines = [line.decode().strip() for line in stream.response if line.strip()]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        usage = json.loads(lines[-2][len("data: "):])["usage"]
        last = json.loads(lines[-3][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length"
        assert usage["completion_tokens"] < 2000  # cut, not finished
        assert proc.wait(30) == 0 and time.time() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
