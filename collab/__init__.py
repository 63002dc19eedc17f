"""hivemind glue shared by the trainer and the monitor: DHT, record schemas, optimizer, callback."""

from collab import hivemind_fixes  # noqa: F401  (patches hivemind before any DHT or averager process starts)
