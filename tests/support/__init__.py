"""Helpers shared by the test tiers: what the suite runs against, and the real parts it starts."""
