import sys

from agent_loop.cli.tiny import main

sys.exit(main())
