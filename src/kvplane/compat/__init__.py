"""Drop-in facades with other projects' Python interfaces (``kvplane.compat.mooncake``)."""
