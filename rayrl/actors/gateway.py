"""GatewayActor: the Ray actor over `rayrl.gateway.Gateway`; its output goes to its log file (rayrl.logs)."""

import ray

from rayrl.gateway import Gateway
from rayrl.logs import to_file

GatewayActor = ray.remote(to_file(Gateway))
