import sys

from agent_loop.inspect import main

sys.exit(main())
