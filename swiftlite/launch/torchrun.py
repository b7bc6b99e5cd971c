"""torch's own launcher (torch.distributed.run), minus its traceback. `plan_launch` runs it as
`python -m swiftlite.torchrun ...` (swiftlite/torchrun.py, a shim of this module).

When a rank fails, torchrun raises ChildFailedError and prints a Python traceback plus a failure
table. swiftlite's launcher already shows the failing rank's own one-line error (from
<output_dir>/logs/rank<r>.err), so here the launcher's exception becomes a plain exit code.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return 2 if 2 in codes else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
