"""wmo_trio: run serialized agent-harness candidates as harbor agents on Trio."""

__version__ = "0.1.0"
