"""Data preparation for the collaborative training client."""
