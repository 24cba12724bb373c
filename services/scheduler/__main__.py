"""`python -m services.scheduler --config FILE`."""

import asyncio

from services.scheduler.service import Scheduler
from shared.config import service_args

if __name__ == "__main__":
    cfg, _ = service_args("scheduler")  # one scheduler per cluster: no instance id
    asyncio.run(Scheduler(cfg).run())
