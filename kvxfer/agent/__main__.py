"""``python -m kvxfer.agent CMD_FD EVENT_FD COPIED_FD [--any-cpu]``: a rank's transfer agent (the engine starts it).

It runs on the CPUs of the engine thread that started it (``connector.agent_cpus: engine``), or
with ``--any-cpu`` on every CPU this process may use; set before any import starts a thread, as
threads take their creator's mask.
"""

import logging
import os
import sys

logging.basicConfig(level=int(os.environ.get("KVXFER_AGENT_LOG_LEVEL", logging.WARNING)),
                    format=f"%(asctime)s %(levelname)s kvxfer-agent[{os.getpid()}] %(name)s: %(message)s")
if "--any-cpu" in sys.argv[1:]:
    sys.argv.remove("--any-cpu")
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps what the cpuset allows
    except (AttributeError, OSError) as e:
        logging.getLogger("kvxfer.agent").warning("agent_cpus: any: the agent keeps its engine's CPUs (%s)", e)

from kvxfer.agent.server import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
