"""The registered patches (filled in by the CPU-harness work)."""
