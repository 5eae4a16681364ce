"""zerodram's front door: the `zerodram` CLI, the torchrun worker entry and the dashboard."""
