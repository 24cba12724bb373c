"""`python -m services.gateway --config FILE`: the HTTP front door on cfg.host:cfg.port."""

import uvicorn

from services.gateway.app import create_app
from services.gateway.gateway import Gateway
from shared.config import service_args

if __name__ == "__main__":
    cfg, _ = service_args("gateway")  # gateways are stateless: no instance id
    uvicorn.run(create_app(Gateway(cfg)), host=cfg.host, port=cfg.port, log_level="warning")
