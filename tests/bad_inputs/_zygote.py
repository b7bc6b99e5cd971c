"""Runs CLI invocations for the bad-input catalogue, each in its own forked process.

Importing torch and transformers takes seconds; the catalogue has dozens of cases. This process
imports them once, then forks one child per request: the child chdirs, sets its environment,
points fd 1/2 at files, runs `swiftlite.cli.main(argv)` exactly as `swiftlite ...` would, and exits
with its return code. Protocol: one JSON request per line on stdin ({"argv", "cwd", "env", "out",
"err"}), one JSON reply per line on the original stdout ({"rc"}).
"""

import json
import os
import sys
import traceback

reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # nothing of ours may reach the reply channel

import swiftlite.cli  # noqa: E402,F401
import swiftlite.config  # noqa: E402,F401
import swiftlite.launch  # noqa: E402,F401
import swiftlite.data.pipeline  # noqa: E402,F401
import swiftlite.models.loading  # noqa: E402,F401
import transformers  # noqa: E402
from transformers import AutoTokenizer, CONFIG_MAPPING  # noqa: E402,F401

_ = CONFIG_MAPPING.get("llama")
# What most cases reach before their error and would otherwise import once per forked child: peft
# (with transformers' generation code, seconds), the preflight, the backends' resolution and the
# optimizer checks (the 234 cases: 591 s -> 91 s on 2 cores). DeepSpeed is left to the cases that use it.
import peft  # noqa: E402,F401
import swiftlite.launch.preflight  # noqa: E402,F401
import swiftlite.optim  # noqa: E402,F401
import swiftlite.parallel.resolve  # noqa: E402,F401
import transformers.optimization  # noqa: E402,F401


def child(req: dict) -> None:
    os.chdir(req["cwd"])
    for k in list(os.environ):
        if k not in req["env"]:
            del os.environ[k]
    os.environ.update(req["env"])
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sys.argv = ["swiftlite", *req["argv"]]
    rc = 1
    try:
        rc = swiftlite.cli.main(list(req["argv"]))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(rc if isinstance(rc, int) else 1)


for line in sys.stdin:
    if not line.strip():
        continue
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    reply.write(json.dumps({"rc": rc}) + "\n")
