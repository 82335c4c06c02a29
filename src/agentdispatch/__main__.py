"""``python -m agentdispatch`` runs the CLI."""

from .cli import main

main()
