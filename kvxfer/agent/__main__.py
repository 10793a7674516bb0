"""``python -m kvxfer.agent CMD_FD EVENT_FD``: a rank's transfer agent (the engine starts it)."""

import logging
import os
import sys

from kvxfer.agent.server import main

logging.basicConfig(level=int(os.environ.get("KVXFER_AGENT_LOG_LEVEL", logging.WARNING)),
                    format=f"%(asctime)s %(levelname)s kvxfer-agent[{os.getpid()}] %(name)s: %(message)s")
sys.exit(main(sys.argv[1:]))
