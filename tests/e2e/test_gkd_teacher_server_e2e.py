"""GKD with its teacher behind a server (`--teacher_model_server`, rlhf/teacher_server.py): `swiftlite deploy`
serves vLLM's OpenAI /v1/completions with prompt_logprobs (rollout/server.py), and a run distilling the
served teacher's top-k log-probabilities trains as the run with the same teacher loaded locally at the same
--gkd_logits_topk: dataset steps and sampled ones, padded and padding-free batches. The server's answer has
vLLM's shape, and what it refuses it says."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import spawn_cli
from tests.e2e.test_gkd_e2e import _run, data  # noqa: F401  (the fixture)


def _teacher_folder(d):
    """The tiny-llama preset's shape with seed-1 weights, as an HF folder (the server and the local run load it)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from swiftlite.models.presets import TINY_TOKENIZER, get_preset
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(LlamaConfig(**get_preset("tiny-llama").config)).save_pretrained(d)
    for f in TINY_TOKENIZER.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from tests.e2e.test_rollout_server import _port
    d = _teacher_folder(tmp_path_factory.mktemp("teacher") / "teacher")
    port = _port()
    log = d.parent / "deploy.log"
    proc = spawn_cli(["deploy", "--model", str(d), "--port", str(port), "--host", "127.0.0.1", "--torch_dtype", "fp32",
                      "--max_logprobs", "8"], log=log)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            break
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.3)
    yield {"dir": d, "url": url}
    proc.terminate()
    assert proc.wait(timeout=30) == 0, log.read_text()


def _post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return 200, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_server_answers_prompt_logprobs_in_vllms_shape(teacher):
    import torch
    from transformers import AutoModelForCausalLM
    ids = [[5, 17, 42, 99, 7], [3, 8]]
    code, ans = _post(teacher["url"], {"model": "x", "prompt": ids, "max_tokens": 1, "temperature": 0,
                                       "prompt_logprobs": 3})
    assert code == 200 and [c["index"] for c in ans["choices"]] == [0, 1]
    model = AutoModelForCausalLM.from_pretrained(teacher["dir"]).eval()
    for seq, choice in zip(ids, ans["choices"]):
        rows = choice["prompt_logprobs"]
        assert len(rows) == len(seq) and rows[0] is None
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        assert choice["token_ids"] == [int(logits[-1].argmax())]
        for j in range(1, len(seq)):
            got = {int(t): v for t, v in rows[j].items()}
            top = torch.topk(lp[j - 1], 3)
            want = {int(i): float(v) for v, i in zip(top.values, top.indices)}
            assert set(want) <= set(got) and len(got) == 3 + (seq[j] not in want)   # the prompt's token added
            for t, v in want.items():
                assert got[t]["logprob"] == pytest.approx(v, abs=1e-5)
            assert [got[t]["rank"] for t in want] == [1, 2, 3]
            assert got[seq[j]]["logprob"] == pytest.approx(float(lp[j - 1, seq[j]]), abs=1e-5)
    code, ans = _post(teacher["url"], {"prompt": [[1, 2]], "prompt_logprobs": 9})
    assert code == 400 and "--max_logprobs 8" in ans["error"]
    code, ans = _post(teacher["url"], {"prompt": "text", "prompt_logprobs": 2})
    assert code == 400 and "prompt must be token ids" in ans["error"]
    code, ans = _post(teacher["url"], {"prompt": [[1, 2]], "prompt_logprobs": 2, "max_tokens": 5})
    assert code == 400 and "scores prompts (max_tokens 1" in ans["error"]


@pytest.mark.parametrize("extra", [["--lmbda", "0"], ["--lmbda", "1"], ["--lmbda", "0.5", "--padding-free", "true"]],
                         ids=["dataset", "sampled", "padding-free"])
def test_a_served_teacher_trains_as_the_same_teacher_loaded_locally(data, teacher, tmp_path, extra):
    common = ["--gkd-logits-topk", "4", "--max-steps", "2", "--save-strategy", "no", "--log-completions", "true",
              *extra]
    proc, served = _run(data, tmp_path / "served", "--teacher_model_server", teacher["url"], *common)
    assert f"teacher: the teacher server {teacher['url']} (its top 4 log-probabilities" in proc.stdout
    _, local = _run(data, tmp_path / "local", "--teacher-model", str(teacher["dir"]), *common)
    assert len(served) == len(local) == 2 and all(s["jsd"] > 1e-3 for s in local)
    for a, b in zip(local, served):
        assert a["on_policy"] == b["on_policy"]
        for k in ("loss", "jsd", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (a["step"], k)


def test_refusals(data, tmp_path):
    proc, _ = _run(data, tmp_path / "bad", "--teacher_model_server", "http://127.0.0.1:9", "--max-steps", "1",
                   check=False)
    assert proc.returncode == 2 and "--teacher-model-server needs --gkd-logits-topk K" in proc.stderr
    proc, _ = _run(data, tmp_path / "bad2", "--teacher_model_server", "http://127.0.0.1:9", "--teacher-model",
                   "tiny-llama", "--gkd-logits-topk", "4", "--max-steps", "1", check=False)
    assert proc.returncode == 2 and "one teacher, local or served" in proc.stderr
    proc, _ = _run(data, tmp_path / "bad3", "--teacher_model_server", "http://127.0.0.1:9", "--gkd-logits-topk", "4",
                   "--vllm_server_timeout", "2", "--max-steps", "1", check=False)
    assert proc.returncode == 2 and "no teacher server answered GET /v1/models within 2 s" in proc.stderr
    assert not (tmp_path / "bad3").exists()
