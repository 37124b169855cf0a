"""TaskQueueActor: the Ray actor over `rayrl.queue.TaskQueue`."""

import ray

from rayrl.queue import TaskQueue

TaskQueueActor = ray.remote(num_cpus=0, max_concurrency=1000)(TaskQueue)
