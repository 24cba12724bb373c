"""`python -m services.scheduler --config FILE [--instance NAME]`: NAME when several run
(control_plane.schedulers; the launcher names them scheduler-0, scheduler-1, ...)."""

import asyncio

from services.scheduler.service import Scheduler
from shared.config import service_args

if __name__ == "__main__":
    cfg, name = service_args("scheduler")
    asyncio.run(Scheduler(cfg, name=name or cfg.control_plane.scheduler_names[0]).run())
