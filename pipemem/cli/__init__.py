"""Command-line interface: `pipemem <command>`; one module per command (cmd_<name>.py)."""
