"""The process `test_rejoin.Restarts` starts in the killed rank's place. It notes when its interpreter
came up and when each import ended (what a restarted process pays before ubep does anything), as
`Rejoining.stages` does (wall clock, CPU seconds), then rejoins (`test_rejoin.restarted`)."""

import sys
import time

stages = {"interpreter": (time.time(), time.process_time())}
import torch  # noqa: E402, F401  (each import after the first stamp, timed on its own)

stages["import torch"] = (time.time(), time.process_time())
import ubep  # noqa: E402, F401

stages["import ubep"] = (time.time(), time.process_time())
from test_rejoin import restarted  # noqa: E402

stages["test helpers"] = (time.time(), time.process_time())  # pytest and the test's reference: not a rejoin's

if __name__ == "__main__":
    restarted(sys.argv[1], float(sys.argv[2]), stages)
