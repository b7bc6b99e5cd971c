"""`swiftlite rollout`'s flags reach RolloutOptions as given, and what one engine does not use is said
(the server itself is tested in tests/e2e/test_rollout_server.py; here `serve` is replaced by a recorder)."""

from __future__ import annotations

import pytest

from swiftlite.cli.main import main


@pytest.fixture
def served(monkeypatch):
    got = []
    import swiftlite.rollout.server as server
    monkeypatch.setattr(server, "serve", lambda o, **kw: got.append(o) or 0)
    return got


def test_msswift_spellings_reach_the_options(served, capsys):
    assert main(["rollout", "--model", "m", "--vllm-tensor-parallel-size", "2", "--vllm_gpu_memory_utilization",
                 "0.5", "--vllm_enforce_eager", "--vllm_enable_prefix_caching", "false", "--torch_dtype", "bfloat16",
                 "--port", "8123"]) == 0
    o = served[0]
    assert (o.infer_backend, o.vllm_tensor_parallel_size, o.vllm_gpu_memory_utilization, o.port) == ("vllm", 2, 0.5, 8123)
    assert o.vllm_enforce_eager is True and o.vllm_enable_prefix_caching is False and o.torch_dtype == "bf16"
    assert capsys.readouterr().err == ""       # nothing to say with the vLLM engine


def test_vllm_options_with_the_transformers_engine_are_said(served, capsys):
    assert main(["rollout", "--model", "m", "--infer_backend", "transformers", "--vllm_max_model_len", "512",
                 "--vllm_enforce_eager"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--vllm_max_model_len, --vllm_enforce_eager: vLLM engine options, not used" in err
    assert "--vllm_gpu_memory_utilization" not in err          # left at its default: nothing said


def test_enable_lora_is_said(served, capsys):
    assert main(["rollout", "--model", "m", "--vllm_enable_lora", "true"]) == 0
    assert "no LoRA adapter is loaded" in capsys.readouterr().err and served[0].vllm_enable_lora is True
