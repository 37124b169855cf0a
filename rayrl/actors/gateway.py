"""GatewayActor: the Ray actor over `rayrl.gateway.Gateway`."""

import ray

from rayrl.gateway import Gateway

GatewayActor = ray.remote(Gateway)
