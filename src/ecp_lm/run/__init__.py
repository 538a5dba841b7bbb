"""A run on disk: its configuration (``RunConfig``), its checkpoints and its folder."""
