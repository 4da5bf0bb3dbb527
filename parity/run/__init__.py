"""Running a suite: selection, isolation in worker processes, sharding over GPUs, the results stream, resume."""
