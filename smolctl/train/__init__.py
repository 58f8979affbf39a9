import os

# Kineto (torch.profiler's backend) prints a line per profiler start/stop unless told otherwise before torch loads;
# the monitor profiles a step every logging.profile_interval steps and those lines would cut into the console.
os.environ.setdefault("KINETO_LOG_LEVEL", "3")
