import sys

from agent_loop.cli import main

sys.exit(main())
