"""``python -m kelastic.agent``: the same as the ``kelastic-agent`` command."""

from kelastic.agent.cli import main

if __name__ == "__main__":
    main()
