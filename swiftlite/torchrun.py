"""`python -m swiftlite.torchrun`: the command `launch.plan_launch` runs; the code is launch/torchrun.py."""
import sys

from swiftlite.launch.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
