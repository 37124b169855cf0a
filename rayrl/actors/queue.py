"""TaskQueueActor: the Ray actor over `rayrl.queue.TaskQueue`; its output goes to its log file (rayrl.logs)."""

import ray

from rayrl.logs import to_file
from rayrl.queue import TaskQueue

TaskQueueActor = ray.remote(num_cpus=0, max_concurrency=1000)(to_file(TaskQueue))
