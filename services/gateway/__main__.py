"""`python -m services.gateway --config FILE`: the HTTP front door on cfg.host:cfg.port."""

import argparse
import logging

import uvicorn

from services.gateway.app import create_app
from services.gateway.gateway import Gateway
from shared.config import load_config

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="services.gateway")
    parser.add_argument("--config", default=None)
    parser.add_argument("--instance", default=None, help="ignored (gateways are stateless)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    cfg = load_config(args.config)
    uvicorn.run(create_app(Gateway(cfg)), host=cfg.host, port=cfg.port, log_level="warning")
