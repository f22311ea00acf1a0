import sys

from agent_loop.cli.train import main

sys.exit(main())
