"""hivemind glue shared by the trainer and the monitor: DHT, record schemas, optimizer, callback."""
