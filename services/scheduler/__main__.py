"""`python -m services.scheduler --config FILE`."""

import argparse
import asyncio
import logging

from services.scheduler.service import Scheduler
from shared.config import load_config

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="services.scheduler")
    parser.add_argument("--config", default=None)
    parser.add_argument("--instance", default=None, help="ignored (one scheduler per cluster)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    asyncio.run(Scheduler(load_config(args.config)).run())
