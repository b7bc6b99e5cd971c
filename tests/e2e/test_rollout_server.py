"""GRPO in `--use_vllm true --vllm_mode server` against a real `swiftlite rollout` server
(`--infer_backend transformers`, the engine a CPU can run): the run's weights reach the server every
round and its completions are the ones the run samples in-process without --use_vllm, bit for bit (the
server starts from other random weights, so equal completions prove the sync), on one process with
LoRA (merged weights sent), two FSDP2 processes (full, gathered), and two ZeRO-3 processes with
--move_model_batches (LoRA, batch by batch). A server started on another model is refused in one line
naming the parameter, and the server's API answers a bad request with its reason."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import run_cli, spawn_cli

COMMON = ["--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "3",
          "--gradient-accumulation-steps", "2", "--num-generations", "4", "--max-completion-length", "6",
          "--logging-steps", "1", "--save-hf-model", "false", "--reward-funcs", "length", "--learning-rate", "1e-2",
          "--log-completions", "true", "--temperature", "1.5"]
PLUGIN = '''from swiftlite.plugin import orms
orms["length"] = lambda completions, **kwargs: [len(c) / 10 for c in completions]
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rollout")
    words = ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]
    (d / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"}], "solution": w[::-1]}) + "\n"
        for w in words))
    (d / "plugin.py").write_text(PLUGIN)
    return d


def _server(tmp_path_factory, extra=(), model="tiny-llama-2l"):
    """A server on the run's architecture with other random weights (seed 0; the runs use seed 3)."""
    port = _port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = spawn_cli(["rollout", "--model", str(model), "--seed", "0", "--infer_backend", "transformers",
                      "--torch_dtype", "fp32", "--port", str(port), "--host", "127.0.0.1", *extra], log=log)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while True:
        try:
            _get(url + "/health/")
            break
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.3)
    return proc, {"port": port, "url": url, "log": log}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, srv = _server(tmp_path_factory)
    yield srv
    proc.terminate()
    assert proc.wait(timeout=30) == 0, srv["log"].read_text()   # SIGTERM stops it cleanly


@pytest.fixture(scope="module")
def server_dp2(tmp_path_factory):
    """Two copies of the engine behind one server (ms-swift's `swift rollout --data_parallel_size 2`)."""
    proc, srv = _server(tmp_path_factory, ("--data_parallel_size", "2"))
    yield srv
    proc.terminate()
    assert proc.wait(timeout=60) == 0, srv["log"].read_text()   # the copies stop with it


def _run(files, out, extra, srv=None):
    args = ["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--external-plugins", files / "plugin.py",
            *extra, "--output-dir", out]
    if srv is not None:
        args += ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
                 "--vllm_server_port", str(srv["port"]), "--vllm_server_group_port", str(_port())]
    return run_cli(args)


def _record(out):
    steps = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in x]
    comps = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    return [(s["step"], s["loss"], s["reward"]) for s in steps], [(c["step"], c["completion"]) for c in comps]


@pytest.mark.parametrize("extra", [
    pytest.param(["--parallelism", "single", "--per-device-train-batch-size", "4", "--max-steps", "3"], id="lora"),
    pytest.param(["--parallelism", "fsdp", "--nproc-per-node", "2", "--per-device-train-batch-size", "2",
                  "--train-type", "full", "--max-steps", "3"], id="fsdp2-full"),
    pytest.param(["--deepspeed", "zero3", "--nproc-per-node", "2", "--per-device-train-batch-size", "2",
                  "--move_model_batches", "2", "--max-steps", "2"], id="zero3-lora-batches"),
])
def test_server_completions_equal_the_in_process_ones(files, server, tmp_path, extra):
    proc = _run(files, tmp_path / "srv", extra, server)
    local = list(extra)
    if "--move_model_batches" in local:     # an option of the sync only
        del local[local.index("--move_model_batches"):local.index("--move_model_batches") + 2]
    _run(files, tmp_path / "local", local)
    assert "grpo (" in proc.stdout
    srv_steps, srv_comps = _record(tmp_path / "srv")
    loc_steps, loc_comps = _record(tmp_path / "local")
    assert srv_comps == loc_comps and len({c for _, c in srv_comps}) > 1
    assert [s[0] for s in srv_steps] == [s[0] for s in loc_steps]
    for (_, l1, r1), (_, l2, r2) in zip(srv_steps, loc_steps):
        assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-9) and r1 == pytest.approx(r2, rel=1e-6)
    assert srv_steps[-1][1] != srv_steps[0][1]          # trained: later rounds come from updated weights


def test_a_data_parallel_server_gives_the_same_completions(files, server_dp2, tmp_path):
    """Both copies join the weight-sync group (world size 2 + the run), both get every weight, and each
    round's micro-batches are dealt between them: the run's completions and losses are the in-process ones."""
    info = _get(server_dp2["url"] + "/get_world_size/")
    assert info["world_size"] == 2 and info["data_parallel_size"] == 2
    extra = ["--parallelism", "single", "--per-device-train-batch-size", "4", "--max-steps", "3"]
    _run(files, tmp_path / "srv", extra, server_dp2)
    _run(files, tmp_path / "local", extra)
    srv_steps, srv_comps = _record(tmp_path / "srv")
    loc_steps, loc_comps = _record(tmp_path / "local")
    assert srv_comps == loc_comps and len({c for _, c in srv_comps}) > 1
    for (_, l1, r1), (_, l2, r2) in zip(srv_steps, loc_steps):
        assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-9) and r1 == pytest.approx(r2, rel=1e-6)
    assert "x 2 (data parallel)" in server_dp2["log"].read_text()


def test_a_server_on_another_model_is_refused_naming_the_parameter(files, server, tmp_path):
    proc = run_cli(["rlhf", *[x if x != "tiny-llama-2l" else "tiny-llama" for x in COMMON], "--dataset",
                    files / "data.jsonl", "--external-plugins", files / "plugin.py", "--parallelism", "single",
                    "--per-device-train-batch-size", "4", "--max-steps", "1", "--use_vllm", "true", "--vllm_mode",
                    "server", "--vllm_server_base_url", server["url"], "--vllm_server_group_port", str(_port()),
                    "--output-dir", tmp_path / "o"], check=False)
    assert proc.returncode == 2, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert err[0].startswith(f"error: rollout server {server['url']}: its model has ") and \
        "start `swiftlite rollout` with the run's --model" in err[0]
    assert not list((tmp_path / "o").glob("checkpoint-*"))


def test_the_api_answers_a_bad_request_with_its_reason(server):
    info = _get(server["url"] + "/get_world_size/")
    assert info["world_size"] == 1 and info["engine"] == "transformers" and info["dtype"] == "float32"
    assert info["params"]["model.layers.1.mlp.down_proj.weight"] == [64, 176]
    req = urllib.request.Request(server["url"] + "/infer/", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"groups": [[[1, 2]]], "seeds": [[1, 2]], "max_tokens": 2,
                                                  "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop_token_ids": [0],
                                                  "pad_id": 0}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and json.loads(e.value.read())["error"] == "/infer/: one seed per prompt"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server["url"] + "/nope/", timeout=5)
    assert e.value.code == 404
    assert _get(server["url"] + "/health/") == {"status": "ok"}    # and it goes on serving
