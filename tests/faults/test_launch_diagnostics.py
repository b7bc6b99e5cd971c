"""The launcher's one-line verdict on a failed job, and redaction of secrets in printed commands."""

from pathlib import Path

from swiftlite.launch import explain_failure, redact_argv

GLOO_CLOSED = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5258. "
               "This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation"
STACK = """Current thread 0x00007f3ca4454b80 (most recent call first):
  File "/x/swiftlite/faults.py", line 104 in maybe_inject
  File "/x/swiftlite/trainer.py", line 177 in train
"""


def logs(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    for name, text in files.items():
        (d / name.replace("_", ".")).write_text(text)
    return d


def test_a_raising_rank_is_named_not_its_victims(tmp_path):
    d = logs(tmp_path, rank0_err=GLOO_CLOSED + "\ntrace", rank1_err="InjectedFault: injected fault (rank 1)\ntrace")
    msg, code = explain_failure(d, 2, "", 1800, 10)
    assert msg == "rank1 failed: InjectedFault: injected fault (rank 1)" and code == 1


def test_a_user_error_in_a_rank_exits_2(tmp_path):
    d = logs(tmp_path, rank1_err="user error: --dataset x: file not found\n")
    assert explain_failure(d, 2, "", 1800, 1) == ("rank1 failed: --dataset x: file not found", 2)


def test_a_hung_rank_is_named_with_where_it_hung(tmp_path):
    d = logs(tmp_path, rank0_err=GLOO_TIMEOUT, rank1_stack=STACK)
    tail = "E... failed (exitcode: 1) local_rank: 0 (pid: 25029) of binary: python3\n"
    msg, code = explain_failure(d, 2, tail, 20, 60)
    assert msg.startswith("rank1 hung: stopped answering collectives (stuck at faults.py:104 in maybe_inject()")
    assert "rank0 gave up after --ddp-timeout 20s" in msg and code == 1


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    d = logs(tmp_path, rank0_err=GLOO_CLOSED)
    tail = "E1130 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 25349) of binary: python3\n"
    msg, _ = explain_failure(d, 2, tail, 1800, 10)
    assert msg.startswith("rank1 died from signal 9 without reporting an error; rank0 gave up:")


SEGV = """Fatal Python error: Segmentation fault

Current thread 0x00007f3ca4454b80 (most recent call first):
  File "/x/bitsandbytes/functional.py", line 1200 in dequantize_4bit
  File "/x/swiftlite/train/step.py", line 88 in forward
"""


def test_a_crashed_rank_is_named_with_where_it_crashed(tmp_path):
    d = logs(tmp_path, rank0_stack=SEGV)
    msg, code = explain_failure(d, 2, "", 1800, 10, codes={0: -11})
    assert msg == ("rank0 ended with signal 11 without reporting an error "
                   "(at functional.py:1200 in dequantize_4bit())") and code == 1
    (tmp_path / "victim").mkdir()
    d = logs(tmp_path / "victim", rank0_stack=SEGV, rank1_err=GLOO_CLOSED)
    msg, _ = explain_failure(d, 2, "", 1800, 10, codes={0: -11})
    assert msg.startswith("rank0 died from signal 11 without reporting an error (at functional.py:1200 in "
                          "dequantize_4bit()); rank1 gave up:")


def test_nothing_reported(tmp_path):
    msg, code = explain_failure(tmp_path / "nologs", 2, "", 1800, 3)
    assert "no rank reporting an error" in msg and code == 0


def test_redact_argv():
    argv = ["swiftlite", "sft", "--hub-token", "hf_abcdefghijklmnopqrstuvwxyz123", "--hub_token=hf_zzz",
            "--api-key", "k", "--dataset", "d.jsonl", "--note", "hf_ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    out = redact_argv(argv)
    assert out == ["swiftlite", "sft", "--hub-token", "***", "--hub_token=***", "--api-key", "***",
                   "--dataset", "d.jsonl", "--note", "***"]


def test_args_json_redacts_secret_fields():
    from swiftlite.config import redact_secrets
    d = {"model": {"model": "m", "hub_token": "hf_x", "max_new_tokens": 3}, "x": [{"password": "p"}]}
    assert redact_secrets(d) == {"model": {"model": "m", "hub_token": "***", "max_new_tokens": 3},
                                 "x": [{"password": "***"}]}
