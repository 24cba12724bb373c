"""Run by tests/test_forkserver.py through the fork server: `python -m tests.forkserver_child
report CODE` prints what the child sees and exits with CODE; `... sleep` waits for a signal."""

import atexit
import json
import os
import signal
import sys

preloaded = "torch" in sys.modules  # before anything here imports it

if __name__ == "__main__":
    atexit.register(print, "atexit ran")
    if sys.argv[1] == "sleep":
        print("sleeping", flush=True)
        signal.pause()
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "sid": os.getsid(0),
                "preloaded": preloaded,
                "main": __name__,
                "comm": open("/proc/self/comm").read().strip(),
            }
        )
    )
    sys.exit(int(sys.argv[2]))
